"""`loom data prepare` killed with SIGKILL half-way, then run again, writes the same bytes (issue 19).

Compared against: an uninterrupted preparation of the same corpus (byte-identical shards and meta).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from loom.data.prepare import prepare

CHILD = """
import sys, time
from loom.data import shards
from loom.data.prepare import prepare
commit = shards.ShardWriter.commit
def slow_commit(self, position):  # slow enough for the parent to kill it between two shards
    commit(self, position)
    time.sleep(0.15)
shards.ShardWriter.commit = slow_commit
prepare([sys.argv[1]], sys.argv[2], tokenizer="bpe", vocab_size=300, seed=5, shard_tokens=2000,
        chunk_chars=3000, workers=2)
"""


def corpus(path: Path) -> Path:
    with open(path, "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": f"def g{i}(y):\n    return y ** {i % 7} - {i}  # doc {i}\n"}) + "\n")
    return path


def test_sigkill_half_way_then_rerun_gives_identical_shards(tmp_path):
    inp = corpus(tmp_path / "c.jsonl")
    ref = tmp_path / "ref"
    kw = dict(tokenizer="bpe", vocab_size=300, seed=5, shard_tokens=2000, chunk_chars=3000)
    meta = prepare([inp], ref, workers=1, **kw)
    n_train = meta["splits"]["train"]["shards"]
    assert n_train >= 6

    out = tmp_path / "out"
    progress = tmp_path / ".out.loom-tmp" / "progress.json"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(inp), str(out)], start_new_session=True)
    done = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        try:
            done = json.loads(progress.read_text())["splits"]["train"]["shards"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= n_train // 2:
            break
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL and 0 < done < n_train  # killed half-way
    assert not out.exists()

    again = prepare([inp], out, workers=2, **kw)  # continues from the last complete shard
    names = sorted(p.name for p in ref.glob("*.bin"))
    assert names == sorted(p.name for p in out.glob("*.bin"))
    for name in names:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert {k: v for k, v in again.items() if k not in ("encode_seconds", "source")} == {
        k: v for k, v in meta.items() if k not in ("encode_seconds", "source")
    }
