"""Property tests (hypothesis) of everything that parses user bytes: the config file, config overrides,
config tables, the shard readers of every token format, meta.json / meta.pkl and checkpoint manifests.
The property: each input either parses or raises LoomError (a message for the user), never another
exception."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom import checkpoint
from loom.config import Config, apply_dict, load_config, validate
from loom.data import formats, megatron, shards
from loom.data.safe_pickle import load_restricted
from loom.errors import LoomError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = ["run", "data", "model", "train", "optim", "precision", "parallel", "n_layer", "lr", "steps", "dir",
        "name", "dtype", "timeout_s", "resume", "x"]  # fmt: skip
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)  # fmt: skip
VALUES = st.recursive(SCALARS, lambda v: st.lists(v, max_size=3) | st.dictionaries(st.sampled_from(KEYS), v, max_size=3),
                      max_leaves=8)  # fmt: skip


def parses_or_loom_error(fn, *args):
    try:
        return fn(*args)
    except LoomError as e:
        assert str(e).strip()  # a message, not an empty error
        return None


def _file(data: bytes, name: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="loomprop"))
    p = d / name
    p.write_bytes(data)
    return p


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
    ),  # fmt: skip
    max_size=12,
).map("".join)


@SETTINGS
@given(st.one_of(st.binary(max_size=300), TOML_ISH.map(str.encode)))
def test_config_file_bytes(data):
    parses_or_loom_error(_config_and_validate, _file(data, "c.toml"))


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_config_tables(table):
    cfg = Config()
    if parses_or_loom_error(apply_dict, cfg, table) is None and table:
        return
    parses_or_loom_error(validate, cfg)


@SETTINGS
@given(st.lists(st.one_of(st.text(max_size=30), st.sampled_from(["--model.n_layer=2", "--optim.lr=-1",
       "--train.steps", "--x", "--a.b=c", "--train.resume=auto", "--optim.lr=nan", "=", "--"])), max_size=4))  # fmt: skip
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
    ),  # fmt: skip
)


def _read_all(arr):
    return int(np.asarray(arr[: min(len(arr), 64)]).sum()) if len(arr) else 0


@SETTINGS
@given(SHARD_BYTES)
def test_llmc_shard_bytes(data):
    p = _file(data, "train_000000.bin")
    parses_or_loom_error(lambda: _read_all(shards.read_shard(p)))
    parses_or_loom_error(lambda: _read_all(formats.FORMATS["llmc"].open(p)))


@SETTINGS
@given(st.binary(max_size=600))
def test_nanogpt_and_npy_bytes(data):
    parses_or_loom_error(lambda: _read_all(formats.FORMATS["nanogpt"].open(_file(data, "train.bin"))))
    npy = st_npy_prefix(data)
    parses_or_loom_error(lambda: _read_all(formats.FORMATS["npy"].open(_file(npy, "x_train_000000.npy"))))


def st_npy_prefix(data: bytes) -> bytes:
    """Half the cases start with a real .npy header, so the reader gets past the magic."""
    if data[:1] and data[0] % 2:
        return b"\x93NUMPY\x01\x00" + len(data).to_bytes(2, "little") + data
    return data


@SETTINGS
@given(st.binary(max_size=400), st.binary(max_size=400))
def test_megatron_bytes(idx, body):
    p = _file(body, "train_000000.bin")
    (p.parent / "train_000000.idx").write_bytes(megatron.MAGIC + idx if idx[:1] == b"\x01" else idx)
    parses_or_loom_error(lambda: _read_all(formats.FORMATS["megatron"].open(p)))


@SETTINGS
@given(st.binary(max_size=300))
def test_meta_and_pickle_bytes(data):
    d = _file(data, "meta.json").parent
    (d / "train_000000.bin").write_bytes(_header(ntok=2) + b"\x01\x00\x02\x00")
    (d / "val_000000.bin").write_bytes(_header(ntok=2) + b"\x01\x00\x02\x00")
    parses_or_loom_error(formats.check_dir, d)
    parses_or_loom_error(load_restricted, data)
    parses_or_loom_error(load_restricted, b"\x80\x04" + data)


@SETTINGS
@given(st.one_of(st.binary(max_size=200), VALUES.map(lambda v: json.dumps({"files": v}).encode())))
def test_checkpoint_manifest_bytes(data):
    d = _file(data, "manifest.json").parent / "step_000001"
    d.mkdir()
    (d / "manifest.json").write_bytes(data)
    parses_or_loom_error(checkpoint.verify, d)
    parses_or_loom_error(checkpoint.latest_valid, d.parent)


@SETTINGS
@given(VALUES)
def test_meta_tokenizer_entry(tok):
    """meta.json parses, but its tokenizer entry is anything: loading the tokenizer must say so."""
    from loom.data.tokenizers import load_tokenizer

    d = _file(json.dumps({"vocab_size": 50, "tokenizer": tok}).encode(), "meta.json").parent
    meta = formats.read_meta(d)
    if meta.get("tokenizer"):
        parses_or_loom_error(load_tokenizer, d, meta)
