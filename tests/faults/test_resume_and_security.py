"""train.resume=auto (continue a named run if it has a valid checkpoint, else start it), the stop-request
signal handling in one process, and the security rules: no pickle load of user data (checked in the
source), file names from meta.json and manifests confined to their folder. Compared against the files
written and the messages given."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from faultkit import last_step, run_inprocess, train_args

import loom
from loom.data.tokenizers import copy_tokenizer, load_tokenizer
from loom.errors import LoomError
from loom.train.guard import StopRequest


def test_resume_auto_starts_then_continues_then_restarts_a_run_without_checkpoints(
    char_data, tmp_path, capsys
):
    args = train_args(char_data, tmp_path, "a", 4, "--train.resume=auto", "--train.ckpt_every=2")
    assert run_inprocess(args) == 0  # nothing there: a new run
    assert "continuing" not in capsys.readouterr().out
    assert run_inprocess([*args, "--train.steps=6"]) == 0  # the same command, longer: continues
    out = capsys.readouterr().out
    assert "continuing" in out and f"resumed from {tmp_path / 'a' / 'ckpt' / 'step_000004'} at step 4" in out
    assert last_step(tmp_path / "a") == 6
    shutil.rmtree(tmp_path / "a" / "ckpt")  # died before its first checkpoint
    assert run_inprocess([*args, "--train.steps=6"]) == 0
    assert "has no valid checkpoint: starting it again" in capsys.readouterr().out
    assert last_step(tmp_path / "a") == 6


def test_stop_request_flag_and_second_interrupt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    stop = StopRequest(rank=1, grace_s=60).install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # handled between bytecodes: only a flag, no exit
        assert stop.requested and stop.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # by hand, a Ctrl-C after the stop request means now
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # handlers given back


def test_tokenizer_file_cannot_point_outside_the_data(tmp_path):
    (tmp_path / "data").mkdir()
    meta = {"vocab_size": 10, "tokenizer": {"kind": "bpe", "file": "../../outside.json"}}
    with pytest.raises(LoomError, match="file must be a plain name"):
        load_tokenizer(tmp_path / "data", meta)
    with pytest.raises(LoomError, match="file must be a plain name"):
        copy_tokenizer(tmp_path / "data", meta, tmp_path / "run" / "tokenizer")
    assert not (tmp_path / "outside.json").exists() and not (tmp_path / "run").exists()


def _calls(tree: ast.AST, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
            yield node


def test_no_pickle_load_of_user_data_in_the_source():
    """torch.load always with weights_only=True, np.load with allow_pickle=False, no pickle.load(s)."""
    bad = []
    for path in Path(loom.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, "load"):
            owner = getattr(call.func.value, "id", "")
            kw = {k.arg: k.value for k in call.keywords}
            if owner == "torch" and not (
                isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            ):
                bad.append(f"{path.name}:{call.lineno} torch.load without weights_only=True")
            if owner == "np" and not (
                isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is False
            ):
                bad.append(f"{path.name}:{call.lineno} np.load without allow_pickle=False")
            if owner == "pickle":
                bad.append(f"{path.name}:{call.lineno} pickle.load")
        bad += [
            f"{path.name}:{c.lineno} pickle.loads"
            for c in _calls(tree, "loads")
            if getattr(c.func.value, "id", "") == "pickle"
        ]
    assert not bad, bad


def test_checkpoint_state_is_json_and_tensors_only(char_data, tmp_path):
    assert run_inprocess(train_args(char_data, tmp_path, "r", 2)) == 0
    step = tmp_path / "r" / "ckpt" / "step_000002"
    json.loads((step / "state.json").read_text())
    import torch

    torch.load(step / "extra.pt", weights_only=True)  # loads under the restricted unpickler
    from loom.parallel.dcp_state import read_whole

    for part in ("model", "optim"):  # DCP shards: raw tensor bytes; .metadata under an allow-list unpickler
        assert read_whole(step / part)


def test_checkpoint_metadata_with_code_is_refused(char_data, tmp_path):
    import os
    import pickle

    from loom.errors import LoomError
    from loom.parallel.dcp_state import read_whole

    assert run_inprocess(train_args(char_data, tmp_path, "r", 1)) == 0
    meta = tmp_path / "r" / "ckpt" / "step_000001" / "model" / ".metadata"

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    meta.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(LoomError, match="not allowed in checkpoint metadata"):
        read_whole(meta.parent)
    assert not (tmp_path / "pwned").exists()
