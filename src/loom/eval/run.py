"""Evaluating a trained run (layer 4): what `loom eval` calls once it has parsed its arguments. The validation
loss of a run's data, HellaSwag, lm-evaluation-harness tasks and CORE, on one process, split over the ranks of
a job (each with the whole model), or FSDP-sharded over them (`shard`). Each prints the command's result on
rank 0; capability scores are also written to <run>/evals/step_N.json (and `json`), and over several runs
(seeds) their spread is printed.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from loom.errors import LoomError
from loom.runs import LoadedRun, load_run, open_run


@dataclass
class CapabilityRequest:
    """`loom eval --tasks ... / --suite core`: what to score on which runs, and how."""

    runs: list[str]
    tasks: str | None = None  # lm-evaluation-harness names, comma-separated
    bundle: str | None = None  # the CORE bundle folder (--suite core)
    limit: int | None = None  # examples per task
    num_fewshot: int | None = None
    include_path: str | None = None
    batch_size: int = 16
    bootstrap_iters: int = 0
    json: str | None = None  # also write the results here
    shard: bool = False
    ckpt: str | None = None  # one checkpoint of one run


def check_capability(req: CapabilityRequest) -> None:
    """What a capability evaluation refuses before any task is read: runs that are not loom runs, and the
    options that name one run (--shard, --ckpt) with several; the --json file's folder is made here."""
    for r in req.runs:
        if not (Path(r) / "config.toml").is_file():
            raise LoomError(
                f"'{r}' is not a loom run (no config.toml)", hint="give run directories of loom train"
            )
    if req.shard and len(req.runs) > 1:
        raise LoomError("--shard scores one run per job", hint="start one job per run")
    if req.ckpt and (len(req.runs) > 1 or req.shard):
        raise LoomError(
            "--ckpt names one checkpoint of one run, read whole", hint="leave out --runs / --shard"
        )
    if req.json:  # checked, and its folder made, before the tasks are read and the runs scored
        from loom.paths import check_output_file

        check_output_file(req.json, "--json")
        Path(req.json).parent.mkdir(parents=True, exist_ok=True)


def evaluate_capability(req: CapabilityRequest, device, env) -> list[dict]:
    """lm-evaluation-harness tasks and/or CORE on each run of `req`: the tasks and the bundle are read before any
    model. One process; a job whose ranks each hold the model (the harness splits the requests); or `shard`
    (FSDP over the job, forwards in lockstep: the caller leaves the job after). Returns rank 0's records.
    `req` has passed check_capability."""
    from loom.eval import core, harness

    tasks = harness.load_tasks(req.tasks, req.include_path, req.num_fewshot) if req.tasks else None
    core_tasks = core.read_bundle(req.bundle, req.limit) if req.bundle else None
    records = []
    if req.shard or env.world_size == 1:
        for r in req.runs:
            with open_run(r, device, env, ckpt=req.ckpt, shard=req.shard) as run:
                records.append(score_run(req, r, run, tasks, core_tasks, env))
        return records
    import torch.distributed as dist  # every rank holds the whole model; the harness splits the requests

    from loom import log
    from loom.distributed import process_group

    log.setup(rank=env.rank)
    process_group.init(env, device, 600.0)
    try:
        for r in req.runs:
            cfg, model, tok, _, path = load_run(r, device, req.ckpt)
            run = LoadedRun(model, tok, cfg, path, device, env.rank, env.world_size, None)
            records.append(score_run(req, r, run, tasks, core_tasks, env))
        dist.barrier()
    finally:
        process_group.shutdown()
    return records


def score_run(req: CapabilityRequest, run_dir, run: LoadedRun, tasks, core_tasks, env) -> dict:
    """One run's scores: the harness's table and CORE printed, <run>/evals/step_N.json (and --json) written."""
    import torch

    from loom.eval import capability, core, harness
    from loom.metrics import has_bf16

    lm = harness.make_lm(
        run.model,
        run.tok,
        run.device,
        batch_size=req.batch_size,
        autocast=(lambda: torch.autocast(run.device.type, dtype=torch.bfloat16))
        if has_bf16(run.device)
        else None,
        rank=env.rank if env.world_size > 1 else 0,
        world_size=env.world_size,
        sharded=req.shard,
    )
    if tasks is not None:
        harness.check_encodable(tasks, run.tok, req.limit)
    results = harness.evaluate(lm, tasks, req.limit, req.bootstrap_iters) if tasks is not None else None
    core_r = core.evaluate(lm, core_tasks) if core_tasks else None
    if env.rank != 0:
        return {}
    m = re.search(r"step_(\d+)", str(run.path))
    step = int(m.group(1)) if m else None
    print(f"checkpoint {run.path} ({env.world_size} process(es){', sharded' if req.shard else ''})")
    out = {"run": str(run_dir), "checkpoint": str(run.path), "step": step}
    out["scores"] = capability.record_of(results, core_r)  # the keys an in-loop record has
    if results is not None:
        print(harness.table(results))
        out["results"] = {k: results.get(k) for k in ("results", "groups", "n-shot", "versions", "n-samples")}
    if core_r is not None:
        _print_core(core_r)
        out["core"] = core_r
    _write_record(out, run_dir, step, req.json)
    return out


def _print_core(core_r: dict) -> None:
    width = max(len(k) for k in core_r["accuracy"])
    for label, acc in core_r["accuracy"].items():
        print(
            f"{label:<{width}}  accuracy {acc:.4f}  centered {core_r['centered'][label]:+.4f}  "
            f"({core_r['n'][label]} examples)"
        )
    print(f"CORE {core_r['core']:.4f} ({len(core_r['accuracy'])} tasks)")


def _write_record(out: dict, run_dir, step: int | None, also: str | None) -> None:
    """<run>/evals/step_N.json (final.json for a checkpoint without a step), and `also` when given."""
    text = json.dumps(out, indent=1, default=str)
    evals = Path(run_dir) / "evals"
    evals.mkdir(exist_ok=True)
    name = f"step_{step}.json" if step is not None else "final.json"
    (evals / name).write_text(text, encoding="utf-8")
    if also:
        Path(also).write_text(text, encoding="utf-8")


def print_spread(records: list[dict]) -> None:
    """Several runs: each score's mean ± standard deviation and range over the runs."""
    if len(records) < 2:
        return
    keys = [k for k in records[0]["scores"] if all(k in r["scores"] for r in records)]
    print(f"\nover {len(records)} runs: mean ± std (min - max)")
    for k in keys:
        v = [r["scores"][k] for r in records]
        print(f"  {k:<40} {statistics.mean(v):.4f} ± {statistics.stdev(v):.4f} ({min(v):.4f} - {max(v):.4f})")


def evaluate_val(run: LoadedRun, run_dir, data: str | None, batches: int | None, shard: bool) -> None:
    """Validation loss (perplexity, bits per byte) of a run's model on its data or `data` (same tokenizer);
    in a job of several processes (the model sharded, or whole on each) the ranks each score a share of the
    windows."""
    from loom.eval.val_loss import val_loss

    cfg, tok = run.cfg, run.tok
    data_dir, data_meta = _val_data(run_dir, cfg, data)
    n_rows = (cfg.train.eval_batches if batches is None else batches) * cfg.train.batch_size
    vs, what = _val_set(cfg, data_dir, data_meta, n_rows, run)
    micro = cfg.train.micro_batch_size or cfg.train.batch_size
    loss = val_loss(run.model, vs, micro, run.device, all_reduce_sum=run.all_reduce_sum)
    line = f"val loss {loss:.4f} | perplexity {math.exp(loss):.2f}"
    # bits per byte: comparable across tokenizers (not an SFT set's measure: ChatValSet says so)
    if tok is not None and getattr(vs, "tokens_per_byte", True) is not False:
        from loom.eval.val_loss import bits_per_byte, tokens_per_byte

        tpb = tokens_per_byte(vs, tok, run.device, run.all_reduce_sum)
        line += f" | bits per byte {bits_per_byte(loss, tpb):.4f}"
    if run.rank == 0:
        split = _split(run, shard) if run.world > 1 else ""
        print(f"checkpoint {run.path}\ndata {data_dir} ({vs.total_rows} {what})" + split)
        print(line)


def _val_data(run_dir, cfg, data: str | None) -> tuple[Path, dict]:
    """The data directory to score (the run's, or `data`) and its meta, refused when its tokenizer is not the
    run's (by vocabulary size, then by content)."""
    from loom.data.formats import check_dir
    from loom.data.loader import read_meta
    from loom.data.tokenizers import check_same_tokenizer, run_tokenizer_dir
    from loom.runs import run_data_dir

    meta = read_meta(run_tokenizer_dir(run_dir))
    data_dir = Path(data) if data else run_data_dir(run_dir, cfg)
    data_meta = check_dir(data_dir)  # every shard opened
    if data_meta["vocab_size"] != meta["vocab_size"]:
        raise LoomError(
            f"'{data_dir}' was prepared with another tokenizer than the run's (vocabulary of "
            f"{data_meta['vocab_size']}, the run's {meta['vocab_size']})",
            hint="prepare it with the run's tokenizer (<run>/tokenizer/)",
        )
    check_same_tokenizer(Path(run_dir) / "tokenizer", meta, data_dir, data_meta)  # by content, not size
    return data_dir, data_meta


def _val_set(cfg, data_dir: Path, data_meta: dict, n_rows: int, run: LoadedRun):
    """The validation set the run itself measured, and what its rows are: for chat data (SFT) the val
    conversations packed as training packed them, only the assistant's tokens scored (loom.data.sft), as the
    run's own val loss; for text, windows of the token stream, every token scored."""
    from loom.data.sft import is_chat_data, validation_set
    from loom.data.slice import DataSlice

    block = cfg.model.block_size
    vs = validation_set(cfg, data_dir, data_meta, n_rows, DataSlice(run.rank, run.world))
    if is_chat_data(data_meta):
        packing = "several a row, each to itself" if cfg.data.doc_mask else "one a row"
        return (
            vs,
            f"rows of {block} tokens: conversations {packing}, the assistant's tokens scored (as the run)",
        )
    return vs, f"windows of {block} tokens"


def _split(run: LoadedRun, shard: bool) -> str:
    if shard:
        return f", {_sharding(run.model, run.world)}"
    return f", split over {run.world} processes (each with the whole model; --shard splits the model too)"


def _sharding(model, world: int) -> str:
    """How much of the model this rank holds (a DTensor's numel is the whole tensor's)."""
    from loom.parallel.tensor import local

    here, total = (sum(f(p).numel() for p in model.parameters()) for f in (local, lambda p: p))
    return f"model sharded over {world} processes ({here:,} of its {total:,} parameters on rank 0)"


def evaluate_hellaswag(run_dir, data: str, limit: int | None, device, env, shard: bool) -> None:
    """HellaSwag on one process, or split across the ranks of a torchrun/srun/mpiexec job: each rank with the
    whole model (or, with `shard`, its FSDP share of it) scores examples rank, rank + world, ... The examples
    are read before the model. A sharded job is the caller's to leave."""
    from loom.eval import hellaswag

    examples, lines = hellaswag.read_examples_and_lines(data, limit)  # before the model is read
    if env.world_size > 1 and not shard:  # whole model on every rank, the examples split
        import torch.distributed as dist

        from loom import log
        from loom.distributed import process_group

        _, model, tok, _, path = load_run(run_dir, device)
        _need_tokenizer(run_dir, tok)
        hellaswag.check_encodable(examples, tok, data, lines)  # before any example is scored
        log.setup(rank=env.rank)
        process_group.init(env, device, 600.0)
        try:
            r = hellaswag.evaluate(
                model, tok, examples, device, env.rank, env.world_size, lambda t: (dist.all_reduce(t), t)[1]
            )
        finally:
            process_group.shutdown()
        _print_hellaswag(data, path, r, env)
        return
    with open_run(run_dir, device, env, shard=shard) as run:  # one process, or the model sharded
        _need_tokenizer(run_dir, run.tok)
        hellaswag.check_encodable(examples, run.tok, data, lines)
        r = hellaswag.evaluate(
            run.model, run.tok, examples, run.device, run.rank, run.world, run.all_reduce_sum
        )
        _print_hellaswag(data, run.path, r, env)


def _print_hellaswag(data: str, path, r: dict, env) -> None:
    if env.rank == 0:
        print(f"checkpoint {path}\nhellaswag {data}: {r['n']} examples on {env.world_size} process(es)")
        print(f"acc {r['acc']:.4f} | acc_norm {r['acc_norm']:.4f}")


def _need_tokenizer(run_dir, tok) -> None:
    if tok is None:
        raise LoomError(
            f"run '{run_dir}' has no tokenizer, so HellaSwag text cannot be encoded",
            hint="train on data prepared by loom (or nanogpt data with meta.pkl)",
        )
