"""`loom bench train`: training throughput of a config as given — tokens/s, tokens/s/device, MFU, memory.

    loom bench train [CONFIG] [--steps 20] [--warmup 3] [--rounds 2] [--synthetic]
                     [--ac none,full,selective | --fp8 off,tensorwise,rowwise | --moe-gemm grouped,loop]
                     [--json FILE] [--section.key=value ...]

What is timed is `Trainer.train_step`, the step `loom train` runs (data, forward, backward, clipping,
optimizer), in one process. `--synthetic` replaces the loader with one fixed random batch, so no reads or
gathers are measured. `--ac` compares activation-checkpointing modes on the same config: one trainer per
mode (same seed, same weights), warmed up, then timed in interleaved rounds (none, full, selective, none,
...) so a machine that gets busier during the run slows every mode alike. `--fp8` compares precision.fp8
recipes the same way (each mode's tokens/s over the first mode's is `speed_vs_first`); an fp8 mode's MFU is
against the bf16 peak, as peers report it. `--moe-gemm` compares a mixture of experts' expert GEMMs
(model.moe_gemm: one torch._grouped_mm, or a matmul per expert) the same way.

Memory. "activations" is what one micro-batch's forward pass leaves allocated for the backward pass
(`loom.parallel.ac.activation_bytes`, counted from the allocator's events): the figure activation
checkpointing changes. "peak" is the device's peak allocation on CUDA (reset per mode); on a CPU it is the
process's peak resident set, shared by all modes of the run, so only the activation figure compares them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom import config, log
from loom import device as dev
from loom.data.loader import DeviceBatches
from loom.errors import LoomError
from loom.metrics import peak_memory_bytes
from loom.model.registry import spec_of
from loom.parallel.ac import MODES, activation_bytes

FP8_MODES = ("off", "tensorwise", "rowwise")
MOE_GEMMS = ("grouped", "loop", "auto")  # model.moe_gemm: a mixture of experts' expert GEMMs
SYNTHETIC_DOC_LEN = 2048  # data.doc_mask=true: documents of this many tokens on average (random cuts)
SYNTHETIC_EOT = 0  # the synthetic data's end-of-text id (data.doc_mask=true: the documents of a window)


class SyntheticLoader:
    """The same random batch at every step: the loader's reads and gathers leave the measurement. With
    docs > 0 each row packs about that many documents (SYNTHETIC_EOT at random places opens each, the only
    place the id occurs), for document-masked attention."""

    def __init__(self, batch_size: int, block_size: int, vocab_size: int, seed: int, docs: int = 0):
        g = torch.Generator().manual_seed(seed)
        rows = torch.randint(1 if docs else 0, vocab_size, (batch_size, block_size + 1), generator=g)
        if docs:
            rows.scatter_(1, torch.randint(0, block_size + 1, (batch_size, docs), generator=g), SYNTHETIC_EOT)
        self.x, self.y = rows[:, :-1], rows[:, 1:]
        self.batch_size, self.cursor = batch_size, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.cursor += self.batch_size
        return self.x, self.y

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}


def synthetic_vocab(cfg: config.Config) -> int:
    """model.vocab_size, else the configured data's vocabulary, else (no data folder: --synthetic reads none)
    data.vocab_size, said in a warning."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.path and Path(cfg.data.path).exists():
        from loom.data.loader import read_meta

        try:
            return int(read_meta(cfg.data.path)["vocab_size"])
        except LoomError:
            raise LoomError(
                f"--synthetic: cannot read the vocabulary of data.path '{cfg.data.path}'",
                hint="give the vocabulary with --model.vocab_size=N (e.g. 65 for Tiny Shakespeare characters)",
            ) from None
    if cfg.data.path:  # the folder is not made yet: the benchmark needs no data, only a vocabulary size
        log.warn(
            f"--synthetic: data.path '{cfg.data.path}' does not exist; measuring with a vocabulary of "
            f"{cfg.data.vocab_size} (data.vocab_size): give the data's with --model.vocab_size=N"
        )
        return cfg.data.vocab_size
    if cfg.data.tokenizer == "bpe":  # the built-in corpus's
        return cfg.data.vocab_size
    raise LoomError("--synthetic needs a vocabulary size", hint="pass --model.vocab_size=N")


def write_synthetic_data(out: Path, vocab_size: int, block_size: int, seed: int, docs: bool = False) -> Path:
    """A minimal llm.c-format directory (random tokens) for the trainer's constructor to open; docs: its meta
    names SYNTHETIC_EOT as the end-of-text id (what data.doc_mask=true asks of the data)."""
    from loom.data.shards import version_for_vocab, write_shard

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    version = version_for_vocab(vocab_size)
    for split in ("train", "val"):
        write_shard(out / f"{split}_000000.bin", rng.integers(0, vocab_size, 4 * (block_size + 1)), version)
    tokenizer = {"eot_id": SYNTHETIC_EOT} if docs else None
    meta = {"format": "llm.c", "vocab_size": vocab_size, "tokenizer": tokenizer, "source": "loom bench train"}
    (out / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return out


def _sync(device: torch.device) -> None:
    dev.synchronize(device)


def measure(
    cfg: config.Config,
    modes: list[str],
    steps: int,
    warmup: int,
    rounds: int,
    synthetic: bool,
    work: Path,
    key: str = "ac",
) -> list[dict[str, Any]]:
    """One record per mode: activation-checkpointing modes (key 'ac') or fp8 recipes (key 'fp8'); see the
    module docstring for what is measured."""
    from loom.env import cpu_memory_reuse
    from loom.train.setup import resolve_device

    derived = config.validate(cfg)[0]
    device = resolve_device(cfg.train.device)
    trainers = _trainers(cfg, derived, modes, key, warmup + steps, synthetic, work, device)
    reuse = device.type == "cpu" and cfg.train.reuse_cpu_memory
    with cpu_memory_reuse(reuse):  # as loom train does
        recs = {mode: _warm_up(tr, warmup, derived, device) for mode, tr in trainers.items()}
        per_round = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
        for n in per_round:
            for mode, tr in trainers.items():
                dev.reset_peak(device)
                for _ in range(n):
                    step = tr.train_step()
                    recs[mode]["dts"].append(step["dt"])
                    recs[mode]["comm"].append(step.get("comm_exposed_s", 0.0))
                _sync(device)
                recs[mode]["peak"] = max(recs[mode]["peak"], peak_memory_bytes(device))
    out = []
    base = recs.get("none") if key == "ac" else None
    first = len(recs[modes[0]]["dts"]) / sum(recs[modes[0]]["dts"])
    for mode, tr in trainers.items():
        r = recs[mode]
        row = _row(cfg, derived, device, tr, mode, r, first, warmup, rounds, synthetic)
        if base is not None:
            row["time_vs_none"] = (sum(r["dts"]) / len(r["dts"])) / (sum(base["dts"]) / len(base["dts"]))
            row["activations_vs_none"] = r["activation_bytes"] / max(base["activation_bytes"], 1)
        out.append(row)
    return out


def _trainers(
    cfg, derived, modes: list[str], key: str, steps: int, synthetic: bool, work: Path, device
) -> dict:
    """{mode: a Trainer of cfg with `key` set to mode, for `steps` steps}, on synthetic data or cfg's."""
    from loom.train import Trainer
    from loom.train.setup import resolve_data

    if synthetic:
        vocab = synthetic_vocab(cfg)
        data_dir = write_synthetic_data(
            work / "data", vocab, cfg.model.block_size, cfg.run.seed, cfg.data.doc_mask
        )
        docs = max(1, cfg.model.block_size // SYNTHETIC_DOC_LEN) if cfg.data.doc_mask else 0
    else:
        data_dir = resolve_data(cfg)
    trainers = {}
    for mode in modes:
        c = copy.deepcopy(cfg)
        if key == "fp8":
            c.precision.fp8 = mode
        elif key == "moe_gemm":
            c.model.moe_gemm = mode
        else:
            c.train.activation_checkpointing = mode
        c.train.steps = steps
        tr = Trainer(c, derived, work / f"run-{mode}", data_dir, device)
        tr.stage.begin(tr.parallel, tr._autocast)  # as Trainer.train does: DPO's reference, RL's sampler
        if synthetic:
            tr.stage.batches = DeviceBatches(  # the stage gives the trainer its batches
                SyntheticLoader(c.train.batch_size, c.model.block_size, vocab, c.run.seed, docs), device
            )
        trainers[mode] = tr
    return trainers


def _warm_up(tr, warmup: int, derived, device) -> dict[str, Any]:
    """The mode's warm-up steps, then its activations measured on one micro-batch: its record, to be timed."""
    compile_s = None
    # a compiled model compiles its forward and backward in its first step, which metrics times whole:
    # the warmup runs before the profiled forward below, so that no compile happens outside it
    for _ in range(max(warmup, 1)):
        rec = tr.train_step()
        compile_s = rec.get("compile_s", compile_s)
    x, y = tr.batches.loader.next_batch()
    mb = derived.micro_batch_size
    act = activation_bytes(tr.parallel.forward, x[:mb].to(device), y[:mb].to(device), tr._autocast)
    return {"activation_bytes": act, "compile_s": compile_s, "dts": [], "comm": [], "peak": 0}


def _row(
    cfg, derived, device, tr, mode: str, r: dict, first: float, warmup: int, rounds: int, synthetic: bool
):
    """The record of one mode from its timings r (speed_vs_first: against the first mode's `first` steps/s)."""
    seconds = sum(r["dts"])
    tps = len(r["dts"]) * derived.tokens_per_step / seconds
    return {
        "bench": "train",
        "mode": mode,
        "ac": tr.cfg.train.activation_checkpointing,
        "fp8": tr.cfg.precision.fp8,
        "speed_vs_first": (len(r["dts"]) / seconds) / first,
        "steps": len(r["dts"]),
        "warmup": max(warmup, 1),
        "rounds": rounds,
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / tr.dims.world_size,
        "mfu": tr.throughput.mfu(tps),
        "ms_per_step": 1e3 * seconds / len(r["dts"]),
        "ms_per_step_median": 1e3 * statistics.median(r["dts"]),
        # the share of step time spent waiting on communication (loom.metrics.StepTimer.comm_exposed): 0 in
        # this one-process bench; a job's metrics.jsonl has it per step (comm_exposed_s over dt)
        "comm_exposed_share": sum(r["comm"]) / seconds,
        "activation_bytes": r["activation_bytes"],
        "peak_mem_bytes": r["peak"],
        "peak_mem_kind": "max allocated" if device.type == "cuda" else "process peak RSS (all modes)",
        "compile_s": r["compile_s"],
        **fp8_linears(tr.model),
        "device": str(device),
        "dtype": tr.precision,
        "compile": cfg.train.compile,
        "params": tr.n_params,
        "tokens_per_step": derived.tokens_per_step,
        "micro_batch_size": derived.micro_batch_size,
        "grad_accum": derived.grad_accum,
        "synthetic": synthetic,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def fp8_linears(model: torch.nn.Module) -> dict[str, int]:
    """How many of the model's linears train in float8 (torchao's Float8Linear, a subclass of nn.Linear) out
    of all of them: what an fp8 mode's speed can be credited to."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return {"fp8_linears": sum(type(m).__name__ == "Float8Linear" for m in linears), "linears": len(linears)}


def print_table(records: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    cols = (
        "mode",
        "tokens/s",
        "vs first",
        "tok/s/device",
        "MFU",
        "ms/step",
        "time vs none",
        "activations",
        "vs none",
        "peak mem",
        "compile",
        "comm",
    )
    for c in cols:
        table.add_column(c, justify="left" if c == "mode" else "right")
    for r in records:
        rel = r.get("time_vs_none")
        act = r.get("activations_vs_none")
        table.add_row(
            r["mode"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['speed_vs_first']:.2f}x",
            f"{r['tokens_per_s_per_device']:,.0f}",
            "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            f"{r['ms_per_step']:.1f}",
            "" if rel is None else f"{rel:.2f}x",
            f"{r['activation_bytes'] / 2**20:.1f} MiB",
            "" if act is None else f"{act:.2f}x",
            f"{r['peak_mem_bytes'] / 2**20:.0f} MiB",
            "" if r["compile_s"] is None else f"{r['compile_s']:.1f}s",
            f"{100 * r['comm_exposed_share']:.0f}%",
        )
    log.print_table(table)  # whole in files and pipes, folded in a narrow terminal
    r0 = records[0]
    log.info(
        f"{r0['params'] / 1e6:.2f}M params | {r0['tokens_per_step']:,} tokens/step | {r0['dtype']} | "
        f"{r0['device']} ({r0['threads']} threads) | {'synthetic data' if r0['synthetic'] else 'real data'}"
        f" | {r0['steps']} timed steps per mode in {r0['rounds']} interleaved rounds | peak mem: "
        f"{r0['peak_mem_kind']}"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom bench train",
        description="Training throughput of a config: tokens/s, tokens/s/device, MFU, memory.",
        epilog="Any config key can be set as --section.key=value (see loom train --help-config).",
    )
    p.add_argument("config", nargs="?", help="a TOML config file (default: loom's defaults)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, per mode (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds the timed steps are cut into")
    p.add_argument("--synthetic", action="store_true", help="one fixed random batch: no data I/O")
    p.add_argument(
        "--ac",
        default=None,
        help="activation checkpointing modes to compare, e.g. none,full,selective "
        "(default: the config's train.activation_checkpointing)",
    )
    p.add_argument(
        "--fp8",
        default=None,
        help="precision.fp8 recipes to compare, e.g. off,tensorwise,rowwise (not with --ac)",
    )
    p.add_argument(
        "--moe-gemm",
        default=None,
        help="model.moe_gemm implementations to compare on a mixture of experts, e.g. grouped,loop",
    )
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    return p


def train_main(argv: list[str]) -> int:
    """`loom bench train`: time the training step of a config, per activation-checkpointing mode."""
    args, rest = _parser().parse_known_args(argv)
    args.config, rest = config.config_argv(argv, args.config, rest)
    cfg = config.load_config(args.config, rest)
    given = {"ac": args.ac, "fp8": args.fp8, "moe_gemm": args.moe_gemm}
    if sum(bool(v) for v in given.values()) > 1:
        raise LoomError(
            "--ac, --fp8 and --moe-gemm each compare modes: give one", hint="run the other comparison apart"
        )
    key = next((k for k, v in given.items() if v), "ac")
    known, given = {"ac": MODES, "fp8": FP8_MODES, "moe_gemm": MOE_GEMMS}[key], given[key]
    if key == "moe_gemm" and not spec_of(cfg).expert_parallel:
        raise LoomError("--moe-gemm compares a mixture of experts' GEMMs", hint="set --model.family=moe")
    modes = (
        [m.strip() for m in given.split(",") if m.strip()] if given else [cfg.train.activation_checkpointing]
    )
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise LoomError(
            f"--{key.replace('_', '-')}: unknown mode(s) {', '.join(bad) or '(none)'}",
            hint=f"use {','.join(known)}",
        )
    if key == "fp8":  # each recipe's bad input before any trainer is built
        for m in modes:
            config.validate(dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, fp8=m)))
    if args.steps < 1 or args.warmup < 0 or not 1 <= args.rounds <= args.steps:
        raise LoomError(
            "need --steps >= 1, --warmup >= 0 and 1 <= --rounds <= --steps; got "
            f"--steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}"
        )
    if args.json:
        from loom.paths import check_output_file

        check_output_file(args.json, "--json")  # before the benchmark, not after it
    with tempfile.TemporaryDirectory(prefix="loom-bench-train-") as tmp:
        records = measure(
            cfg,
            list(dict.fromkeys(modes)),
            args.steps,
            args.warmup,
            args.rounds,
            args.synthetic,
            Path(tmp),
            key,
        )
    for r in records:
        r["config"] = args.config
    print_table(records, f"loom bench train: {args.config or 'defaults'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
        log.info(f"wrote {args.json}")
    return 0
