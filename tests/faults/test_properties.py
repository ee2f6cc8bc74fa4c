"""Property tests (hypothesis) of everything that parses user bytes: the config file, config overrides,
config tables, the shard readers of every token format, meta.json / meta.pkl and checkpoint manifests.
The property: each input either parses or raises LoomError (a message for the user), never another
exception. For config tables also the converse, against values generated within each rule of validate():
a valid table is accepted as given, and every accepted config survives config -> TOML -> config."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loom.model  # noqa: F401  (registers the built-in families a config names)
from loom import checkpoint
from loom.config import CHOICES, Config, all_keys, apply_dict, apply_family, load_config, to_toml, validate
from loom.data import formats, megatron, shards
from loom.data.safe_pickle import load_restricted
from loom.errors import LoomError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = [
    "run",
    "data",
    "model",
    "train",
    "optim",
    "precision",
    "parallel",
    "n_layer",
    "lr",
    "steps",
    "dir",
    "name",
    "dtype",
    "timeout_s",
    "resume",
    "x",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
VALUES = st.recursive(
    SCALARS,
    lambda v: st.lists(v, max_size=3) | st.dictionaries(st.sampled_from(KEYS), v, max_size=3),
    max_leaves=8,
)


def parses_or_loom_error(fn, *args):
    try:
        return fn(*args)
    except LoomError as e:
        assert str(e).strip()  # a message, not an empty error
        return None


@contextlib.contextmanager
def _file(data: bytes, name: str):
    """data written to a file called name, in a temporary folder removed after the example."""
    with tempfile.TemporaryDirectory(prefix="loomprop") as d:
        p = Path(d) / name
        p.write_bytes(data)
        yield p


def _config_and_validate(path):
    cfg = load_config(path)
    validate(cfg)
    return cfg


TOML_ISH = st.lists(
    st.sampled_from(
        [
            "[model]\n",
            "[train]\n",
            "[optim]\n",
            "n_layer = ",
            "lr = ",
            "steps = ",
            "= ",
            "nan",
            "inf",
            "-1",
            "1e400",
            '"x"',
            "true",
            "[1, 2]",
            "{a = 1}",
            "\n",
            "[[a]]\n",
            "\x00",
            "é",
            "[parallel]\ntimeout_s = ",
            "0",
            "resume = ",
            '"auto"',
        ]
    ),
    max_size=12,
).map("".join)


@SETTINGS
@given(st.one_of(st.binary(max_size=300), TOML_ISH.map(str.encode)))
def test_config_file_bytes(data):
    with _file(data, "c.toml") as p:
        parses_or_loom_error(_config_and_validate, p)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_config_tables(table):
    cfg = Config()
    try:
        apply_dict(cfg, table)
    except LoomError as e:  # rejected: with a message, and only then is validate() not reached
        assert str(e).strip()
        return
    parses_or_loom_error(validate, cfg)


def _flat(cfg: Config) -> dict[str, object]:
    """section.key -> value, with NaN made comparable (NaN != NaN)."""
    return {
        f"{s}.{k}": ("nan" if isinstance(v, float) and math.isnan(v) else v)
        for s, kv in cfg.to_dict().items()
        for k, v in kv.items()
    }


def _nest(flat: dict[str, object]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for key, v in flat.items():
        s, k = key.split(".", 1)
        out.setdefault(s, {})[k] = v
    return out


def _assert_round_trips(cfg: Config) -> None:
    with _file(to_toml(cfg).encode(), "config.toml") as p:  # as a run's config.toml is written and read
        assert _flat(load_config(p)) == _flat(cfg)


# Any value of the right type for any real key: what apply_dict accepts must round-trip through TOML.
_DEFAULTS = _flat(Config())
TYPED = {
    bool: st.booleans(),
    int: st.integers(-(2**63), 2**63 - 1),
    str: st.text(max_size=12),
    float: st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**53), 2**53),
}


@SETTINGS
@given(st.lists(st.sampled_from(all_keys()), unique=True, max_size=6), st.data())
def test_accepted_tables_round_trip(keys, data):
    flat = {k: data.draw(TYPED[type(_DEFAULTS[k])], label=k) for k in keys}
    cfg = Config()
    try:
        apply_dict(cfg, _nest(flat))
    except LoomError as e:  # only a value outside a key's choices may be refused here
        assert "must be one of" in str(e)
        return
    _assert_round_trips(cfg)


@st.composite
def valid_tables(draw) -> dict[str, object]:
    """A config table that satisfies every rule of validate() at dp_size=1, one key at a time."""
    t: dict[str, object] = {}
    for (s, k), options in CHOICES.items():
        if s != "parallel" and draw(st.booleans()):
            t[f"{s}.{k}"] = draw(st.sampled_from(options))
    n_head = draw(st.integers(1, 8))
    micro = draw(st.integers(1, 8))
    lr = draw(st.floats(1e-6, 10.0))
    t |= {
        "run.name": draw(st.text(max_size=12)),
        "run.dir": draw(st.text(min_size=1, max_size=12)),
        "run.seed": draw(st.integers(0, 2**32)),
        "model.n_head": n_head,
        "model.n_embd": n_head * 2 * draw(st.integers(1, 8)),
        "model.n_layer": draw(st.integers(1, 12)),
        "model.block_size": draw(st.integers(1, 1024)),
        "model.dropout": draw(st.floats(0.0, 0.99)),
        "model.bias": draw(st.booleans()),
        "model.vocab_size": draw(st.integers(0, 70000)),
        "train.steps": draw(st.integers(1, 10**6)),
        "train.micro_batch_size": micro,
        "train.batch_size": micro * draw(st.integers(1, 8)),
        "train.eval_every": draw(st.integers(0, 1000)),
        "train.log_every": draw(st.integers(0, 1000)),
        "train.keep_last": draw(st.integers(1, 10)),
        "train.spike_window": draw(st.integers(2, 1000)),
        "train.spike_zscore": draw(st.floats(0.0, 100.0)),
        "optim.lr": lr,
        "optim.min_lr": draw(st.floats(0.0, lr)),
        "optim.warmup_steps": draw(st.integers(0, 10**4)),
        "optim.beta1": draw(st.floats(0.0, 0.999)),
        "optim.beta2": draw(st.floats(0.0, 0.9999)),
        "optim.weight_decay": draw(st.floats(0.0, 1.0)),
        "optim.grad_clip": draw(st.floats(0.0, 10.0)),
        "precision.init_scale": draw(st.floats(1.0, 2.0**24)),
        "parallel.timeout_s": draw(st.floats(1.0, 1e5)),
    }
    if t.get("data.doc_positions") == "restart":  # positions restart at document starts: only with doc_mask
        t["data.doc_mask"] = True
    if t.get("precision.fp8", "off") != "off" and t.get("precision.dtype") == "fp16":  # fp8: bf16 or fp32
        t["precision.dtype"] = "bf16"
    if t.get("train.memory_snapshot") == "steps":  # snapshots at chosen steps: the steps given
        t["train.memory_snapshot_steps"] = str(draw(st.integers(1, 10**6)))
    # QLoRA's NF4 base needs LoRA, whose own rules (and NF4's block sizes) are tests/unit/test_qlora.py's
    t.pop("finetune.quantize_base", None)
    if t.get("optim.state_dtype") or t.get("optim.offload", "none") != "none":  # torchao's AdamW variants
        t["optim.name"] = "adamw"
        if t.get("optim.state_dtype") or t.get("train.device") == "cpu":  # low-bit states stay on the device
            t["optim.offload"] = "none"
    return dict(draw(st.permutations(sorted(t.items()))))  # any order of keys


@SETTINGS
@given(valid_tables())
def test_valid_tables_are_accepted_and_round_trip(flat):
    cfg = Config()
    apply_dict(cfg, _nest(flat))  # no LoomError: every value is within its rule
    apply_family(cfg, set(flat))  # the preset of model.family for the model keys the table leaves out
    got = _flat(cfg)
    assert {k: got[k] for k in flat} == {
        k: (float(v) if isinstance(_DEFAULTS[k], float) else v) for k, v in flat.items()
    }
    as_text = [f"--{k}=" + (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in flat.items()]
    assert _flat(load_config(None, as_text)) == got  # the same values as command-line overrides
    derived = validate(cfg)[0]
    assert derived.micro_batch_size == flat["train.micro_batch_size"]
    assert derived.grad_accum == flat["train.batch_size"] // flat["train.micro_batch_size"]
    _assert_round_trips(cfg)


@SETTINGS
@given(
    st.lists(
        st.one_of(
            st.text(max_size=30),
            st.sampled_from(
                [
                    "--model.n_layer=2",
                    "--optim.lr=-1",
                    "--train.steps",
                    "--x",
                    "--a.b=c",
                    "--train.resume=auto",
                    "--optim.lr=nan",
                    "=",
                    "--",
                ]
            ),
        ),
        max_size=4,
    )
)
def test_config_overrides(args):
    parses_or_loom_error(lambda: validate(load_config(None, args)))


def _header(magic=shards.MAGIC, version=1, ntok=0) -> bytes:
    h = np.zeros(shards.HEADER_INTS, dtype="<i4")
    h[:3] = (magic, version, ntok)
    return h.tobytes()


SHARD_BYTES = st.one_of(
    st.binary(max_size=2000),
    st.builds(
        lambda v, n, body: _header(version=v, ntok=n) + body,
        st.sampled_from([0, 1, 2, 3, -1]),
        st.integers(-5, 600),
        st.binary(max_size=1200),
    ),
)


def _read_all(arr):
    return int(np.asarray(arr[: min(len(arr), 64)]).sum()) if len(arr) else 0


@SETTINGS
@given(SHARD_BYTES)
def test_llmc_shard_bytes(data):
    with _file(data, "train_000000.bin") as p:
        parses_or_loom_error(lambda: _read_all(shards.read_shard(p)))
        parses_or_loom_error(lambda: _read_all(formats.FORMATS["llmc"].open(p)))


@SETTINGS
@given(st.sampled_from([(1, "<u2", 2**16 - 1), (2, "<u4", 2**32 - 1)]), st.data())
def test_valid_shards_read_back(layout, data):
    """The converse: well-formed files (llm.c's header written here by hand, raw nanoGPT uint16, .npy) give
    back exactly their tokens, so a reader that refused everything would fail."""
    version, dtype, top = layout
    tokens = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=300), label="tokens")
    body = np.asarray(tokens, dtype=dtype)
    with _file(_header(version=version, ntok=len(tokens)) + body.tobytes(), "train_000000.bin") as p:
        assert np.asarray(shards.read_shard(p)).tolist() == tokens
        assert np.asarray(formats.FORMATS["llmc"].open(p)).tolist() == tokens
    if version == 1:
        with _file(body.tobytes(), "train.bin") as p:
            assert np.asarray(formats.FORMATS["nanogpt"].open(p)).tolist() == tokens
    with _file(b"", "x_train_000000.npy") as p:
        np.save(p, body)
        assert np.asarray(formats.FORMATS["npy"].open(p)).tolist() == tokens


@SETTINGS
@given(st.binary(max_size=600))
def test_nanogpt_and_npy_bytes(data):
    with _file(data, "train.bin") as p:
        parses_or_loom_error(lambda: _read_all(formats.FORMATS["nanogpt"].open(p)))
    with _file(st_npy_prefix(data), "x_train_000000.npy") as p:
        parses_or_loom_error(lambda: _read_all(formats.FORMATS["npy"].open(p)))


def st_npy_prefix(data: bytes) -> bytes:
    """Half the cases start with a real .npy header, so the reader gets past the magic."""
    if data[:1] and data[0] % 2:
        return b"\x93NUMPY\x01\x00" + len(data).to_bytes(2, "little") + data
    return data


@SETTINGS
@given(st.binary(max_size=400), st.binary(max_size=400))
def test_megatron_bytes(idx, body):
    with _file(body, "train_000000.bin") as p:
        (p.parent / "train_000000.idx").write_bytes(megatron.MAGIC + idx if idx[:1] == b"\x01" else idx)
        parses_or_loom_error(lambda: _read_all(formats.FORMATS["megatron"].open(p)))


@SETTINGS
@given(st.binary(max_size=300))
def test_meta_and_pickle_bytes(data):
    with _file(data, "meta.json") as p:
        d = p.parent
        (d / "train_000000.bin").write_bytes(_header(ntok=2) + b"\x01\x00\x02\x00")
        (d / "val_000000.bin").write_bytes(_header(ntok=2) + b"\x01\x00\x02\x00")
        parses_or_loom_error(formats.check_dir, d)
    parses_or_loom_error(load_restricted, data)
    parses_or_loom_error(load_restricted, b"\x80\x04" + data)


@SETTINGS
@given(st.one_of(st.binary(max_size=200), VALUES.map(lambda v: json.dumps({"files": v}).encode())))
def test_checkpoint_manifest_bytes(data):
    with _file(data, "manifest.json") as p:
        d = p.parent / "step_000001"
        d.mkdir()
        (d / "manifest.json").write_bytes(data)
        parses_or_loom_error(checkpoint.verify, d)
        parses_or_loom_error(checkpoint.latest_valid, d.parent)


@SETTINGS
@given(VALUES)
def test_meta_tokenizer_entry(tok):
    """meta.json parses, but its tokenizer entry is anything: loading the tokenizer must say so."""
    from loom.data.tokenizers import load_tokenizer

    with _file(json.dumps({"vocab_size": 50, "tokenizer": tok}).encode(), "meta.json") as p:
        meta = formats.read_meta(p.parent)
        if meta.get("tokenizer"):
            parses_or_loom_error(load_tokenizer, p.parent, meta)
