"""Config resolution against its contract: defaults -> TOML -> overrides, unknown keys with suggestions,
type errors, and validate()'s divisibility rules and derived values."""

import pytest

from loom.config import Config, all_keys, help_text, load_config, to_toml, validate
from loom.errors import LoomError

REQUIRED = """run.dir run.name run.seed data.path data.corpus model.n_layer model.n_head model.n_embd
model.block_size model.dropout model.bias train.steps train.batch_size train.micro_batch_size train.eval_every
train.eval_batches train.ckpt_every train.keep_last train.log_every train.sample_every train.compile optim.lr
optim.min_lr optim.warmup_steps optim.weight_decay optim.beta1 optim.beta2 optim.grad_clip precision.dtype
parallel.dp_impl""".split()


def test_required_keys_exist_and_are_documented():
    keys = set(all_keys())
    assert set(REQUIRED) <= keys
    text = help_text()
    for k in keys:
        assert k in text
    assert text.count("\n      ") == len(keys)  # one doc line per key


def test_resolution_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nn_layer = 6\nn_embd = 96\n[optim]\nlr = 3\n[run]\nname = "x"\n')
    cfg = load_config(f, ["--model.n_layer=8", "--train.compile", "true", "--model.dropout=0.1"])
    assert cfg.model.n_layer == 8  # override beats file
    assert cfg.model.n_embd == 96  # file beats default
    assert cfg.optim.lr == 3.0 and isinstance(cfg.optim.lr, float)  # TOML int accepted for a float
    assert cfg.train.compile is True and cfg.model.dropout == 0.1 and cfg.run.name == "x"
    assert cfg.model.n_head == Config().model.n_head


def test_toml_round_trip(tmp_path):
    cfg = load_config(None, ['--run.name=a "quoted" name', "--model.bias=true"])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_config(f) == cfg


@pytest.mark.parametrize(
    "args,match",
    [
        (["--model.n_layers=3"], "did you mean 'model.n_layer'"),
        (["--modle.n_layer=3"], "did you mean 'model'"),
        (["--train.steps=ten"], "expects int"),
        (["--train.compile=maybe"], "expects bool"),
        (["--precision.dtype=fp8"], "must be one of"),
        (["--train.steps"], "has no value"),
        (["steps=3"], "unrecognised argument"),
    ],
)
def test_bad_overrides(args, match):
    with pytest.raises(LoomError, match=match):
        load_config(None, args)


def test_bad_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nn_layer = 'four'\n")
    with pytest.raises(LoomError, match="expects int"):
        load_config(f)
    f.write_text("this is not toml ===")
    with pytest.raises(LoomError, match="not valid TOML"):
        load_config(f)
    with pytest.raises(LoomError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_validate_derives_accumulation():
    cfg = load_config(None, ["--train.batch_size=32", "--train.micro_batch_size=4", "--model.block_size=64"])
    d = validate(cfg, world=2)[0]
    assert (d.grad_accum, d.tokens_per_step) == (4, 32 * 64)


@pytest.mark.parametrize(
    "args,dp,match",
    [
        (["--train.batch_size=12", "--train.micro_batch_size=5"], 1, "not divisible"),
        (["--train.batch_size=12", "--train.micro_batch_size=4"], 2, "not divisible"),
        (["--model.n_embd=100", "--model.n_head=3"], 1, "not divisible by model.n_head"),
        (["--optim.lr=-1"], 1, "lr > 0"),
        (["--train.steps=0"], 1, "must be positive"),
        (["--model.dropout=1.5"], 1, "dropout"),
    ],
)
def test_validate_errors(args, dp, match):
    with pytest.raises(LoomError, match=match):
        validate(load_config(None, args), world=dp)


def test_an_activation_that_swiglu_does_not_read_is_warned_about(monkeypatch):
    """model.activation set with mlp=swiglu did nothing, silently; the Llama preset alone says nothing."""
    from loom import log

    said = []
    monkeypatch.setattr(log, "warn", said.append)
    load_config(None, ["--model.family=llama"])
    load_config(None, ["--model.activation=gelu"])  # the gelu MLP reads it
    assert said == []
    load_config(None, ["--model.family=llama", "--model.activation=gelu"])
    assert len(said) == 1 and "model.activation=gelu is not used" in said[0] and "model.mlp=gelu" in said[0]
