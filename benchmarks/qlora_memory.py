"""QLoRA's figures on a CPU (issue 63 items 2-4): peak RSS of a ~1B-shaped model with and without an NF4 base,
torchao's low-bit AdamW state, and the val loss of QLoRA SFT against bf16 LoRA SFT.

    python benchmarks/qlora_memory.py rss --mode MODE      # MODE: lora | qlora | qlora-after | adamw | adamw8 | adamw4
    python benchmarks/qlora_memory.py val-loss --work DIR

rss: one process per mode (run each under /work/cpuslot-both or on a quiet machine). A Llama-shaped model of
1.10B parameters (22 layers, n_embd 2048, 16 heads, 4 KV heads, SwiGLU 5632, vocab 32000, untied: TinyLlama's shape)
with random weights, LoRA rank 16 on every block linear; two training steps (batch 1 x 256 tokens, bf16
autocast, AdamW on the adapters). Printed: the peak RSS while the model is built (and quantized), the RSS when
training starts, the peak RSS over the steps (VmHWM reset between: /proc/self/clear_refs). lora: the fp32 base
(loom's one-process LoRA); qlora: loom's trainer path (loom.model.nf4.materialize_nf4, from
loom.train.finetune.quantize_configured): the model made module by module, each base linear quantized as soon as
it has its values (never the whole fp32 base); qlora-after: the whole model built in fp32, then quantized linear
by linear (loom's trainer before materialize_nf4). adamw / adamw8 / adamw4: full training of a 124M-shaped GPT-2 (12 x 768) with torch's AdamW and
torchao's AdamW8bit / AdamW4bit, the optimizer state's bytes and the step's seconds.

val-loss: a 4 x 128 char-level base trained 300 steps on words, then chat SFT (reverse the words; val on
held-out conversations) with LoRA rank 16 on every linear, 200 steps, bf16 autocast: once with the fp32 base,
once with finetune.quantize_base=nf4. Prints each run's val loss curve.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path


def rss_mb(field: str = "VmHWM") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def llama_1b():
    from loom.model.gpt.gpt import GPTConfig

    return GPTConfig(
        vocab_size=32000,
        n_layer=22,
        n_head=16,
        n_kv_head=4,
        n_embd=2048,
        block_size=256,
        ffn_hidden=5632,
        mlp="swiglu",
        norm="rmsnorm",
        pos="rope",
        bias=False,
        tie_embeddings=False,
    )


def rss(mode: str) -> dict:
    import torch

    from loom.env import cpu_memory_release
    from loom.model.gpt.gpt import GPT
    from loom.model.lora import apply_lora, count_trainable

    cpu_memory_release()  # blocks of 1 MiB+ unmapped when freed (as loom's trainer on CPU): RSS is what is held
    torch.manual_seed(0)
    t0 = time.perf_counter()
    out: dict = {"mode": mode, "rss_start_mb": rss_mb("VmRSS")}
    if mode.startswith("adamw"):
        return optim_state(mode)
    cfg = llama_1b()
    if mode == "qlora":  # loom's trainer path: made module by module, each base linear quantized at once
        from loom.model.nf4 import materialize_nf4

        with torch.device("meta"):
            model = GPT(cfg)
        apply_lora(model, 16, 32.0, "all-linear", seed=0)
        materialize_nf4(model, torch.device("cpu"), lambda name, t: model.init_param(name, t, 0), {}, None)
    else:
        model = GPT(cfg)
        apply_lora(model, 16, 32.0, "all-linear", seed=0)
        if mode == "qlora-after":
            from loom.model.nf4 import quantize_base

            quantize_base(model)
    trainable, total = count_trainable(model)
    out.update(params=total, trainable=trainable, build_s=round(time.perf_counter() - t0, 1))
    out["peak_build_mb"] = rss_mb()
    out["rss_ready_mb"] = rss_mb("VmRSS")
    reset_peak()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 256))
    t1 = time.perf_counter()
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["step_s"] = round((time.perf_counter() - t1) / 2, 2)
    out["peak_train_mb"] = rss_mb()
    out["loss"] = round(float(loss), 4)
    return out


def optim_state(mode: str) -> dict:
    import torch

    from loom.config import OptimConfig
    from loom.model.gpt.gpt import GPT, GPTConfig
    from loom.optim.build import build_optimizer

    model = GPT(GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=256))
    ocfg = OptimConfig(state_dtype={"adamw": "", "adamw8": "int8", "adamw4": "int4"}[mode], lr=1e-4)
    opt = build_optimizer(model, ocfg, torch.device("cpu"))
    x = torch.randint(0, 50304, (2, 256))
    reset_peak()
    times = []
    for _ in range(4):
        model(x, x).backward()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)

    def nbytes(t) -> int:
        if type(t) is torch.Tensor:
            return t.numel() * t.element_size()
        inner, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, a)) for a in inner)

    state = sum(nbytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    n = sum(p.numel() for p in model.parameters())
    return {
        "mode": mode,
        "params": n,
        "state_mb": round(state / 2**20, 1),
        "state_bytes_per_param": round(state / n, 3),
        "step_s_first": round(times[0], 2),  # torchao compiles its step on the first call
        "step_s": round(min(times[1:]), 3),
        "peak_train_mb": rss_mb(),
    }


WORDS = "apple river stone cloud green house music paper light table".split()


def val_loss(work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    loom = [sys.executable, "-m", "loom"]
    rng = random.Random(0)
    (work / "base.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(40000)) + " reverse: again\n")
    model = ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=128", "--model.block_size=64"]
    quiet = [
        "--train.sample_every=0",
        "--train.device=cpu",
        "--train.eval_batches=8",
        "--train.batch_size=16",
    ]

    def run(*args: str) -> None:
        subprocess.run([*loom, *args], check=True, stdout=subprocess.DEVNULL)

    run(
        "data",
        "prepare",
        "--input",
        str(work / "base.txt"),
        "--out",
        str(work / "text"),
        "--tokenizer",
        "char",
    )
    run(
        "train",
        f"--data.path={work / 'text'}",
        f"--run.dir={work / 'runs'}",
        "--run.name=base",
        *model,
        *quiet,
        "--train.steps=300",
        "--train.eval_every=0",
        "--precision.dtype=bf16",
    )
    convs = []
    for _ in range(1500):
        w = rng.sample(WORDS, rng.randint(2, 5))
        convs.append(
            {
                "messages": [
                    {"role": "user", "content": "reverse: " + " ".join(w)},
                    {"role": "assistant", "content": " ".join(reversed(w))},
                ]
            }
        )
    (work / "conv.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    run(
        "data",
        "prepare",
        "--chat",
        "--input",
        str(work / "conv.jsonl"),
        "--out",
        str(work / "chat"),
        "--tokenizer",
        str(work / "runs" / "base"),
        "--block-size",
        "64",
    )
    out = {}
    for name, extra in (("lora-bf16", []), ("qlora-nf4", ["--finetune.quantize_base=nf4"])):
        t = time.perf_counter()
        run(
            "train",
            f"--data.path={work / 'chat'}",
            f"--model.init_from=run:{work / 'runs' / 'base'}",
            f"--run.dir={work / 'runs'}",
            f"--run.name={name}",
            *quiet,
            "--precision.dtype=bf16",
            "--finetune.lora_rank=16",
            "--finetune.lora_alpha=32",
            "--finetune.lora_targets=all-linear",
            "--optim.lr=3e-3",
            "--train.steps=200",
            "--train.eval_every=50",
            "--data.doc_mask=true",
            "--data.doc_positions=restart",
            *extra,
        )
        recs = [
            json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
        ]
        out[name] = {
            "val": {r["step"]: round(r["val_loss"], 4) for r in recs if "val_loss" in r},
            "seconds": round(time.perf_counter() - t, 1),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rss")
    r.add_argument(
        "--mode", required=True, choices=("lora", "qlora", "qlora-after", "adamw", "adamw8", "adamw4")
    )
    v = sub.add_parser("val-loss")
    v.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    print(json.dumps(rss(args.mode) if args.what == "rss" else val_loss(args.work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
