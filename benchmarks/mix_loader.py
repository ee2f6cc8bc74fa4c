"""data.mix's loader against the single-source loader (issue 47): rows/s on the same data, and memory at start
for a 100-source mixture of 1 B tokens in all.

    python benchmarks/mix_loader.py [--tokens 1e9] [--sources 100] [--out FILE.json]

Data: nanoGPT-layout folders (train.bin / val.bin, uint16, meta.pkl with the vocabulary) whose files are
sparse: each is created with truncate() to its size, so 1 B tokens (2 GB of ids) take no disk and no time to
write; every id reads as 0, which changes nothing the loaders do per row (they gather windows by position and
check the largest id per batch). Warm page cache throughout.

1. rows/s: `--sources` folders of tokens/sources tokens each; MixLoader over all of them (equal weights)
   against ShardLoader over one folder of as many tokens, and the same for the first 3 sources: the same
   kind of windows gathered from as many pages, the mixture adding each row's source and index. Best of 7 alternating rounds of
   `--batches` global batches of 64 rows x 1024 tokens.
2. memory at start: a fresh process builds the loader (ShardLoader on one folder of all the tokens; MixLoader on
   the `--sources` folders) and reads its first batch; its peak RSS above the same process's after the imports.
"""

from __future__ import annotations

import argparse
import json
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B, T = 64, 1024


def sparse_dir(d: Path, tokens: int) -> None:
    """A nanoGPT-layout folder of `tokens` train ids (and a 1/100 val split), sparse: no data written."""
    d.mkdir(parents=True)
    for split, n in (("train", tokens), ("val", max(tokens // 100, 4 * T))):
        with open(d / f"{split}.bin", "wb") as f:
            f.truncate(2 * n)
    (d / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 50304}))


def build(kind: str, dirs: list[str], seed: int = 0):
    import numpy as np

    from loom.data.loader import ShardLoader
    from loom.data.mix import MixLoader, Source, mix_weights

    if kind == "single":
        return ShardLoader(dirs[0], B, T, seed)
    sources = [Source(f"s{i}", d) for i, d in enumerate(dirs)]
    w = np.full(len(dirs), 1 / len(dirs))
    return MixLoader(sources, mix_weights(w, "", sources), B, T, seed, repeat="allow")


def rows_per_s(single: str, dirs: list[str], batches: int, rounds: int = 7) -> dict:
    """Best rows/s of each loader over `rounds` rounds, the two alternating (a busy machine slows both alike):
    ShardLoader on `single` (as many tokens as all of `dirs`: as many pages to fault in), MixLoader on `dirs`."""
    loaders = {"single": build("single", [single]), "mix": build("mix", dirs)}
    best = dict.fromkeys(loaders, 0.0)
    for ld in loaders.values():
        ld.next_batch()  # first-batch costs (an epoch's order, page faults of the headers) apart
    for _ in range(rounds):
        for name, ld in loaders.items():
            t0 = time.perf_counter()
            for _ in range(batches):
                ld.next_batch()
            best[name] = max(best[name], batches * B / (time.perf_counter() - t0))
    return {**{k: round(v) for k, v in best.items()}, "ratio": round(best["mix"] / best["single"], 3)}


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def start_memory(kind: str, dirs: list[str]) -> dict:
    """Run in a fresh process: its resident memory after the loader's first batch, above what it held after the
    imports (a memory map's pages count once read: the first batch's)."""
    code = (
        "import json, sys; sys.path.insert(0, {!r}); import mix_loader as m; "
        "import numpy, torch, loom.data.mix; base = m.rss_mb(); "
        "l = m.build({!r}, {!r}); l.next_batch(); "
        "print(json.dumps({{'imports_mb': base, 'above_imports_mb': m.rss_mb() - base}}))"
    ).format(str(ROOT / "benchmarks"), kind, dirs)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {**json.loads(out.strip().splitlines()[-1]), "wall_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=1e9)
    p.add_argument("--sources", type=int, default=100)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args()
    total, k = int(args.tokens), args.sources
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [str(Path(tmp) / f"s{i:03d}") for i in range(k)]
        for d in dirs:
            sparse_dir(Path(d), total // k)
        one, three = str(Path(tmp) / "all"), str(Path(tmp) / "three")
        sparse_dir(Path(one), total)
        sparse_dir(Path(three), 3 * (total // k))
        result = {
            "tokens": total,
            "sources": k,
            "batch": [B, T],
            "rows_per_s": rows_per_s(one, dirs, args.batches),
            "rows_per_s_3_sources": rows_per_s(three, dirs[:3], args.batches),
            "start_memory_mb": {
                "single_1_folder": start_memory("single", [one]),
                "mix": start_memory("mix", dirs),
            },
        }
    result["start_memory_mb"]["mix_minus_single_mb"] = round(
        result["start_memory_mb"]["mix"]["above_imports_mb"]
        - result["start_memory_mb"]["single_1_folder"]["above_imports_mb"],
        1,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
