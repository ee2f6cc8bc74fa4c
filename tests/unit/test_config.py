"""Config resolution against its contract: defaults -> TOML -> overrides, unknown keys with suggestions,
type errors, and validate()'s divisibility rules and derived values."""

import pytest

import loom.model  # noqa: F401  (registers the built-in families a config names: llama, moe)
from loom.config import FAMILY_SECTIONS, Config, all_keys, help_text, load_config, to_toml, validate
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
    own = [f"model.{k}" for s in FAMILY_SECTIONS.values() if s.keys for k in s.keys.__dataclass_fields__]
    assert text.count("\n      ") == len(keys) + len(own)  # one doc line per key, a family's own keys too
    # the moe family's keys are listed under it, with their defaults and help
    assert "[model] keys of model.family=moe\n  model.n_experts = 0\n      Routed SwiGLU experts" in text


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


def test_min_lr_follows_lr_unless_set(tmp_path):
    """optim.min_lr unset ends the decay at lr / 10 (docs/models.md's `--optim.lr=3e-5` failed against a fixed
    1e-4); a value a run sets (a config, an old run's config.toml) is kept; a bad one names --optim.min_lr."""
    cfg = load_config(None, ["--optim.lr=3e-5"])
    validate(cfg)
    assert cfg.optim.end_lr() == pytest.approx(3e-6)
    assert load_config(None, []).optim.end_lr() == pytest.approx(1e-4)  # lr 1e-3: the old default's end
    assert load_config(None, ["--optim.min_lr=0"]).optim.end_lr() == 0.0
    old = tmp_path / "config.toml"  # what runs saved before: a number, kept as it is
    old.write_text("[optim]\nlr = 6e-4\nmin_lr = 0.0001\n")
    assert load_config(old, []).optim.end_lr() == 1e-4
    with pytest.raises(LoomError, match="min_lr <= optim.lr") as e:
        validate(load_config(None, ["--optim.lr=3e-5", "--optim.min_lr=1e-4"]))
    assert "--optim.min_lr" in e.value.hint
    with pytest.raises(LoomError, match="min_lr") as e:
        validate(load_config(None, ["--optim.min_lr=-2"]))
    assert "--optim.min_lr" in e.value.hint


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


def test_a_family_owns_its_keys(tmp_path):
    """model.n_experts and the moe_* keys are the moe family's: typed on its section, saved in config.toml,
    refused for another family (unless at their default: the config.toml of runs saved before the families
    owned their keys has all of them), and checked by validate."""
    cfg = load_config(None, ["--model.family=moe", "--model.n_experts=4", "--model.moe_top_k=1"])
    assert type(cfg.model.family_keys).__name__ == "MoEKeys" and cfg.model.n_experts == 4
    f = tmp_path / "moe.toml"
    f.write_text(to_toml(cfg))
    assert "n_experts = 4" in f.read_text() and load_config(f) == cfg
    old = to_toml(load_config(None, ["--model.family=llama"])).replace(
        "[model]\n", "[model]\nn_experts = 0\n"
    )
    f.write_text(old.replace("[model]\n", '[model]\nmoe_gemm = "auto"\n'))
    assert load_config(f).model.family == "llama" and "n_experts" not in to_toml(load_config(f))
    with pytest.raises(LoomError, match="model.n_experts is for model.family=moe; the family is 'gpt2'"):
        load_config(None, ["--model.n_experts=4"])
    with pytest.raises(LoomError, match="model.n_experts is for model.family=moe; the family is 'llama'"):
        load_config(None, ["--model.family=moe", "--model.n_experts=4", "--model.family=llama"])
    with pytest.raises(LoomError, match="model.moe_gemm must be one of auto, grouped, loop; got 'x'"):
        validate(load_config(None, ["--model.family=moe", "--model.moe_gemm=x"]))


def test_runs_without_a_name_started_in_one_second_get_two_folders(tmp_path, monkeypatch):
    """The default run name is the second the run starts in; a second run in that second (a script's next
    command) is named `-2`, not refused as the first run's folder. An explicit run.name still is refused."""
    import time

    from loom.train.setup import resolve_run_dir

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20261202-070000")
    cfg = load_config(None, [f"--run.dir={tmp_path}"])
    first = resolve_run_dir(cfg, None, False)
    assert first == tmp_path / "20261202-070000"
    first.mkdir()
    (first / "config.toml").write_text(to_toml(cfg))
    second = resolve_run_dir(cfg, None, False)
    assert second == tmp_path / "20261202-070000-2"
    second.mkdir()  # an empty folder is not taken: a run that stopped before writing anything
    assert resolve_run_dir(cfg, None, False) == second
    named = load_config(None, [f"--run.dir={tmp_path}", "--run.name=20261202-070000"])
    with pytest.raises(LoomError, match="already holds a run"):
        resolve_run_dir(named, None, False)
