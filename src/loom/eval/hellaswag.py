"""HellaSwag, completion style: which of 4 endings does the model find most likely after the context?

Each ending is scored by the cross-entropy of its tokens given the context (" " + ending, as in
build-nanogpt's hellaswag.py and lm-evaluation-harness). Two accuracies are reported:
  acc       the ending with the lowest total loss (sum over its tokens; favours short endings)
  acc_norm  the ending with the lowest mean loss per token (normalised by the ending's length)
The context is preceded by the end-of-text token, as every document is in loom's data. Examples are
split across ranks (example i on rank i % world) and the counts summed, so any world size gives the same
figures as one process.

Input: the official JSONL layout, one example per line with `ctx` (str), `endings` (4 str), `label` (int).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from loom.errors import LoomError
from loom.eval.evaluator import EvalContext, EvalSetup, Every, json_lines, register_evaluator


def read_examples(path: str | Path, limit: int | None = None, tokenizer=None) -> list[dict]:
    """Examples of a HellaSwag JSONL file, checked field by field (line numbers in the errors); with a
    tokenizer, also checked to encode (`check_encodable`)."""
    examples, lines = read_examples_and_lines(path, limit)
    if tokenizer is not None:
        check_encodable(examples, tokenizer, path, lines)
    return examples


def read_examples_and_lines(path: str | Path, limit: int | None = None) -> tuple[list[dict], list[int]]:
    """read_examples' examples, and the line of the file each came from."""
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"  # a folder, /dev/zero, a FIFO
        raise LoomError(f"HellaSwag file '{p}' {what}", hint="give the path of hellaswag_val.jsonl")
    out, lines = [], []
    for n, ex in json_lines(p):
        ctx, endings, label = (
            ex.get(k) if isinstance(ex, dict) else None for k in ("ctx", "endings", "label")
        )
        if not isinstance(ctx, str) or not (
            isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) and e for e in endings)
        ):
            raise LoomError(
                f"{p}:{n} needs 'ctx' (text) and 'endings' (4 non-empty texts)",
                hint="use the official HellaSwag JSONL (ctx, endings, label)",
            )
        if isinstance(label, str) and label.isdigit():
            label = int(label)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 4:
            raise LoomError(
                f"{p}:{n} has label {label!r}; it must be 0, 1, 2 or 3",
                hint="the test split has no labels: evaluate on hellaswag_val.jsonl",
            )
        out.append({"ctx": ctx, "endings": endings, "label": label})
        lines.append(n)
        if limit and len(out) >= limit:
            break
    if not out:
        raise LoomError(f"HellaSwag file '{p}' holds no examples")
    return out, lines


def check_encodable(examples: list[dict], tokenizer, path: str | Path, lines: list[int]) -> None:
    """Refuse, before any scoring (and before training when the loop evaluates), an example whose context or
    ending the tokenizer cannot encode: a character table lacks characters its corpus never had. Named by
    file and line. Byte-level BPE and tiktoken encode any text, so only a character table is checked."""
    from loom.data.tokenizers import CharTokenizer

    if not isinstance(tokenizer, CharTokenizer):
        return
    for i, ex in enumerate(examples):
        texts = [("ctx", ex["ctx"])] + [(f"ending {j}", " " + e) for j, e in enumerate(ex["endings"])]
        for what, text in texts:
            try:
                tokenizer.encode(text)
            except LoomError as e:
                raise LoomError(
                    f"{path}:{lines[i]}: the {what} cannot be encoded: {e.message}",
                    hint="the run's tokenizer is a character table of its training text: evaluate on examples "
                    "in its characters (--limit, or a filtered file), or train on data prepared with --tokenizer bpe",
                ) from None


def encode_example(ex: dict, tokenizer, block_size: int) -> tuple[list[list[int]], list[int]]:
    """Token rows [eot] + ctx + ending for the 4 endings, and the number of context tokens in each row.

    A row longer than block_size + 1 loses context from the left; an ending longer than the window is
    scored on its first block_size tokens (after one context token)."""
    ctx = [tokenizer.eot_id] + tokenizer.encode(ex["ctx"])
    rows, n_ctx = [], []
    for ending in ex["endings"]:
        end = tokenizer.encode(" " + ending)[:block_size]
        c = ctx[-(block_size + 1 - len(end)) :]
        rows.append(c + end)
        n_ctx.append(len(c))
    return rows, n_ctx


class HellaSwagEval(Every):
    """HellaSwag accuracy over train.hellaswag_data every train.hellaswag_every steps. The examples split across
    the ranks when each holds a whole or FSDP-sharded model; under tensor/pipeline parallelism rank 0 scores them
    all on a gathered copy."""

    name = "hellaswag"

    def __init__(self, examples: list[dict], every: int):
        super().__init__(every)
        self.examples = examples

    def run(self, ctx: EvalContext) -> dict | None:
        par, dims = ctx.parallel, ctx.parallel.dims
        if dims.model_parallel or dims.ep_enabled:
            model, rank, world, reduce = par.sampling_model(), 0, 1, (lambda x: x)
        else:
            model, rank, world, reduce = par.eval_model(), dims.rank, dims.world_size, par.all_reduce_sum
        if model is None:
            return None
        with ctx.autocast():
            hs = evaluate(model, ctx.tokenizer, self.examples, ctx.device, rank, world, reduce)
        return {"hellaswag_acc": hs["acc"], "hellaswag_acc_norm": hs["acc_norm"], "hellaswag_n": hs["n"]}

    def line(self, step: int, record: dict) -> str:
        return (
            f"step {step:>6} | hellaswag acc {record['hellaswag_acc']:.4f} | acc_norm "
            f"{record['hellaswag_acc_norm']:.4f} ({record['hellaswag_n']} examples)"
        )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    tokenizer,
    examples: list[dict],
    device,
    rank: int = 0,
    world_size: int = 1,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    batch_size: int = 16,
) -> dict:
    """acc and acc_norm over all examples; this rank scores examples rank, rank + world, ... Its endings are
    scored as continuations of their contexts by loom.eval.scoring.Scorer (the path of the harness adapter and
    CORE: batched by length), whose forwards run in lockstep across the ranks, so a sharded model, whose
    forward is a collective, stays in step."""
    from loom.eval.scoring import Scorer

    was_training = model.training
    block_size = model.cfg.block_size
    mine = examples[rank::world_size]
    requests = []
    for ex in mine:
        rows, n_ctx = encode_example(ex, tokenizer, block_size)
        requests += [(r[:c], r[c:]) for r, c in zip(rows, n_ctx, strict=True)]
    scorer = Scorer(
        model,
        device,
        tokenizer.eot_id,
        batch_size=batch_size,
        lockstep=all_reduce_sum if world_size > 1 else None,
    )
    answers = scorer.continuations(requests)
    counts = torch.zeros(3, dtype=torch.long, device=device)  # examples, correct (sum), correct (mean)
    for k, ex in enumerate(mine):
        total = torch.tensor([-lp for lp, _ in answers[4 * k : 4 * k + 4]])
        mean = total / torch.tensor([len(cont) for _, cont in requests[4 * k : 4 * k + 4]])
        counts[0] += 1
        counts[1] += int(total.argmin().item() == ex["label"])
        counts[2] += int(mean.argmin().item() == ex["label"])
    n, correct, correct_norm = all_reduce_sum(counts).tolist()
    model.train(was_training)
    return {"n": n, "acc": correct / n, "acc_norm": correct_norm / n}


def _in_training(setup: EvalSetup) -> HellaSwagEval | None:
    """train.hellaswag_every: the examples read and checked at the trainer's start (a bad file fails before the
    model is built)."""
    t = setup.cfg.train
    if not t.hellaswag_every:
        return None
    if setup.tokenizer is None:
        raise LoomError(
            f"train.hellaswag_every needs the data's tokenizer, and '{setup.data_dir}' has none",
            hint="prepare the data with loom (or use nanogpt data with meta.pkl)",
        )
    examples = read_examples(t.hellaswag_data, t.hellaswag_limit or None, setup.tokenizer)  # encodable too
    return HellaSwagEval(examples, t.hellaswag_every)


register_evaluator("hellaswag", _in_training)
