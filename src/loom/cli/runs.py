"""`loom export`, `loom ckpt` and `loom plot`: what reads a finished run's files (its checkpoints, its metrics)
and writes something for other tools or people."""

from __future__ import annotations

import argparse
from pathlib import Path


def export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom export", description="Write a run's model for other tools.")
    p.add_argument("run_dir")
    p.add_argument(
        "--format",
        required=True,
        choices=["hf", "peft", "safetensors", "gguf"],
        help="hf: a transformers directory (GPT2LMHeadModel, or LlamaForCausalLM for the llama family; a "
        "LoRA run's adapters merged); peft: a LoRA run as OUT/base (transformers) and OUT/adapter (peft's "
        "adapter format); safetensors: loom's raw state; gguf: OUT/model-<type>.gguf for llama.cpp (the gpt2 "
        "and llama families, with the tokenizer)",
    )
    p.add_argument(
        "--gguf-type",
        default=None,
        choices=["f16", "bf16", "q8_0"],
        help="--format gguf: the matrices' type (default f16; q8_0: 8-bit blocks of 32; norms stay f32)",
    )
    p.add_argument("--out", required=True, help="output directory (must be empty unless --force)")
    p.add_argument("--ckpt", default=None, help="a checkpoint directory (default: the newest valid one)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    args = p.parse_args(argv)
    from loom.paths import check_output_dir

    if args.gguf_type and args.format != "gguf":
        from loom.errors import LoomError

        raise LoomError(f"--gguf-type is an option of --format gguf, not --format {args.format}")
    check_output_dir(args.out, "--out", temp_beside=True)  # before the checkpoint is read
    import torch

    from loom.model import hf
    from loom.outputs import check_apart, check_replaceable, staged_output
    from loom.runs import load_run

    out = Path(args.out)
    check_apart(out, [args.run_dir, *([args.ckpt] if args.ckpt else [])], inside_ok=True)
    check_replaceable(out, "export", args.force)  # again when written; here before the checkpoint is read
    if args.format == "peft":
        from loom.export import export_peft

        notes = export_peft(args.run_dir, out, args.ckpt, args.force)
    elif args.format == "gguf":
        from loom.export_gguf import export_gguf

        notes = export_gguf(args.run_dir, out, args.ckpt, args.gguf_type or "f16", args.force)
    else:
        cfg, model, tok, meta, path = load_run(args.run_dir, torch.device("cpu"), args.ckpt)
        # written beside --out and renamed when whole: a full disk leaves no export that looks complete
        with staged_output(out, "export", args.force) as tmp:
            if args.format == "hf":
                from loom.export import export_hf_dir

                notes = export_hf_dir(cfg, model, tok, meta, tmp, False)
            else:
                hf.export_safetensors(model, tmp, False)
                notes = [f"wrote {out / 'model.safetensors'} from {path}"]
        if args.format == "hf":
            import json

            config = json.loads((out / "config.json").read_text(encoding="utf-8"))
            arch = config["architectures"][0]
            print(
                f"wrote {args.out} from {path}: a {arch} directory for AutoModelForCausalLM.from_pretrained"
            )
    for n in notes:
        print(n)
    return 0


def ckpt(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="loom ckpt", description="Inspect, consolidate or average a run's checkpoints."
    )
    sub = p.add_subparsers(dest="verb", required=True)
    ins = sub.add_parser("inspect", help="format, step, layout, files and sizes, valid or not")
    ins.add_argument("target", help="a run directory, its ckpt/ folder or one RUN/ckpt/step_N")
    ins.add_argument("--json", action="store_true", help="print JSON")
    con = sub.add_parser("consolidate", help="one model.safetensors + config + tokenizer, tensor by tensor")
    con.add_argument("run_dir")
    con.add_argument("--step", type=int, default=None, help="default: the newest valid checkpoint")
    con.add_argument(
        "--out", required=True, help="output folder (a small run: loom generate/eval/export read it)"
    )
    con.add_argument("--force", action="store_true", help="write into a non-empty output folder")
    avg = sub.add_parser(
        "average", help="the mean of the last N checkpoints' weights (or train.ema's), as consolidate writes"
    )
    avg.add_argument("run_dir")
    avg.add_argument("--last", type=int, default=0, help="average the N newest valid checkpoints")
    avg.add_argument("--ema", action="store_true", help="the newest checkpoint's train.ema average instead")
    avg.add_argument("--out", required=True, help="output folder (loom generate/eval/export read it)")
    avg.add_argument("--force", action="store_true", help="replace a folder loom ckpt wrote")
    args = p.parse_args(argv)
    from loom import checkpoint_tools

    if args.verb == "inspect":
        return checkpoint_tools.inspect_main(args.target, args.json)
    if args.verb == "average":
        target, steps = checkpoint_tools.average(args.run_dir, args.out, args.last, args.ema, args.force)
        what = f"train.ema's average at step {steps[-1]}" if args.ema else f"the mean of steps {steps}"
        print(f"wrote {target} ({what}), config.toml")
        return 0
    target = checkpoint_tools.consolidate(args.run_dir, args.out, args.step, args.force)
    rest = (
        "config.toml and tokenizer/"
        if (target.parent / "tokenizer").is_dir()
        else "config.toml (the run has no tokenizer/)"
    )
    print(f"wrote {target} ({target.stat().st_size / 2**20:.1f} MiB), {rest}")
    return 0


def plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom plot", description="Train and val loss against tokens.")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--out", default=None, help="PNG file (default: <first run>/loss.png)")
    args = p.parse_args(argv)
    from loom.paths import check_output_file
    from loom.plot import plot_runs

    if args.out or Path(args.run_dirs[0]).is_dir():  # before reading the runs
        check_output_file(args.out or Path(args.run_dirs[0]) / "loss.png", "--out")

    out = plot_runs(args.run_dirs, args.out)
    print(f"wrote {out}")
    return 0
