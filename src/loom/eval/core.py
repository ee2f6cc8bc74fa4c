"""The CORE score (DCLM, arXiv 2406.11794; nanochat's headline metric) from the eval bundle the user has.

The bundle (nanochat's eval_bundle.zip, the DCLM suite of 22 tasks) is a folder with
    core.yaml             icl_tasks: [{label, dataset_uri, icl_task_type, num_fewshot: [k], continuation_delimiter}]
    eval_data/<uri>       one JSON object per line
    eval_meta_data.csv    'Eval Task' and 'Random baseline' (in percent) per task label
and three kinds of task:
    multiple_choice     {query, choices, gold}           prompts differ in the choice (their common token prefix
                                                         is the context): the lowest mean loss over the rest wins
    schema              {context_options, continuation, gold}   prompts differ in the context (their common
                                                         token suffix is scored): the lowest mean loss wins
    language_modeling   {context, continuation}          right if greedy decoding produces the continuation
Prompts are rendered as nanochat renders them (k few-shot examples drawn with random.Random(1234 + i) from the
other examples, "\\n\\n" between them), tokenized with the end-of-text token in front, and scored by any harness
`TemplateLM` (loom's adapter, or the harness's hf backend on the exported model: the same requests). Each
accuracy is centred on its random baseline, (acc - b) / (1 - b), and CORE is their mean. With a limit, each
task's examples are shuffled with random.Random(1337) first and the first N kept (as nanochat does).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from loom.errors import LoomError
from loom.eval.evaluator import json_lines

KINDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}
WHERE = (
    "nanochat's eval_bundle.zip (its scripts/base_eval.py names the address), unzipped: the folder holding "
    "core.yaml, eval_meta_data.csv and eval_data/"
)


@dataclass
class CoreTask:
    label: str
    kind: str
    num_fewshot: int
    delimiter: str
    baseline: float  # the random baseline as a fraction
    examples: list[dict]


def read_bundle(bundle: str | Path, limit: int | None = None) -> list[CoreTask]:
    """The bundle's tasks, every example checked for its kind's fields (file and line in the error)."""
    import yaml

    root = Path(bundle)
    cfg_path, meta_path = root / "core.yaml", root / "eval_meta_data.csv"
    for p in (cfg_path, meta_path):
        if not p.is_file():
            raise LoomError(f"'{root}' is not a CORE eval bundle: it has no {p.name}", hint=f"use {WHERE}")
    try:
        cfg = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise LoomError(f"{cfg_path} is not YAML: {e}", hint=f"use {WHERE}") from None
    specs = cfg.get("icl_tasks") if isinstance(cfg, dict) else None
    if not isinstance(specs, list) or not specs:
        raise LoomError(f"{cfg_path} has no 'icl_tasks' list", hint=f"use {WHERE}")
    with open(meta_path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"Eval Task", "Random baseline"} <= set(rows[0]):
        raise LoomError(
            f"{meta_path} needs the columns 'Eval Task' and 'Random baseline'", hint=f"use {WHERE}"
        )
    baselines = {r["Eval Task"]: r["Random baseline"] for r in rows}
    tasks = []
    for n, spec in enumerate(specs):
        need = ("label", "dataset_uri", "icl_task_type", "num_fewshot")
        missing = [k for k in need if not isinstance(spec, dict) or k not in spec]
        if missing:
            raise LoomError(f"{cfg_path}: icl_tasks[{n}] lacks {', '.join(missing)}", hint=f"use {WHERE}")
        label, kind = spec["label"], spec["icl_task_type"]
        if kind not in KINDS:
            raise LoomError(
                f"{cfg_path}: task '{label}' is of type '{kind}'",
                hint=f"CORE scores {', '.join(KINDS)}",
            )
        if label not in baselines:
            raise LoomError(f"{meta_path} has no random baseline for task '{label}'", hint=f"use {WHERE}")
        try:
            baseline = float(baselines[label]) / 100
        except ValueError:
            raise LoomError(f"{meta_path}: the random baseline of '{label}' is not a number") from None
        shots = spec["num_fewshot"]
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(shots, int) or shots < 0:
            raise LoomError(f"{cfg_path}: task '{label}' has num_fewshot {spec['num_fewshot']!r}")
        examples = _read_examples(root / "eval_data" / spec["dataset_uri"], kind)
        random.Random(1337).shuffle(examples)
        if limit:
            examples = examples[:limit]
        if shots >= len(examples):
            raise LoomError(
                f"task '{label}' asks for {shots} few-shot examples and has {len(examples)} examples",
                hint="raise --limit (few-shot examples are drawn from the other examples)",
            )
        delim = spec.get("continuation_delimiter", " ")
        tasks.append(CoreTask(label, kind, shots, delim, baseline, examples))
    return tasks


def _read_examples(path: Path, kind: str) -> list[dict]:
    if not path.is_file():
        raise LoomError(f"the CORE bundle has no data file '{path}'", hint=f"use {WHERE}")
    fields = KINDS[kind]
    out = []
    for n, ex in json_lines(path):
        if not isinstance(ex, dict) or any(k not in ex for k in fields):
            raise LoomError(f"{path}:{n}: a {kind} example needs {', '.join(fields)}", hint=f"use {WHERE}")
        options = ex.get("choices", ex.get("context_options"))
        if "gold" in fields and not (
            isinstance(options, list) and isinstance(ex["gold"], int) and 0 <= ex["gold"] < len(options)
        ):
            raise LoomError(f"{path}:{n}: 'gold' must index the example's options")
        out.append(ex)
    if not out:
        raise LoomError(f"the CORE data file '{path}' holds no examples")
    return out


def prompts(task: CoreTask, i: int) -> list[str]:
    """The prompt texts of example i, with its few-shot examples (nanochat's templates, rendered in Python)."""
    ex, d = task.examples[i], task.delimiter
    shots = []
    if task.num_fewshot:
        others = [j for j in range(len(task.examples)) if j != i]
        shots = [task.examples[j] for j in random.Random(1234 + i).sample(others, task.num_fewshot)]
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{ex['query']}{d}{c}" for c in ex["choices"]]
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{c}{d}{ex['continuation']}" for c in ex["context_options"]]
    head = "".join(f"{s['context'].strip()}{d}{s['continuation']}\n\n" for s in shots)
    without = f"{head}{ex['context'].strip()}{d}"
    return [without.strip(), without + ex["continuation"]]


def _common(seqs: list[list[int]], from_end: bool) -> int:
    n = min(len(s) for s in seqs)
    for k in range(n):
        idx = -1 - k if from_end else k
        if any(s[idx] != seqs[0][idx] for s in seqs):
            return k
    return n


def requests(task: CoreTask, i: int, lm) -> list[tuple[list[int], list[int]]]:
    """(context tokens, scored tokens) per option of example i (one pair for a language-modelling task)."""
    toks = [[lm.prefix_token_id, *lm.tok_encode(p)] for p in prompts(task, i)]
    if task.kind == "multiple_choice":
        start = _common(toks, from_end=False)
        return [(t[:start], t[start:]) for t in toks]
    if task.kind == "schema":
        k = _common(toks, from_end=True)
        return [(t[: len(t) - k], t[len(t) - k :]) for t in toks]
    without, whole = toks
    if whole[: len(without)] != without or len(whole) == len(without):
        raise LoomError(
            f"CORE task '{task.label}', example {i}: the prompt without its continuation does not tokenize to a "
            "prefix of the prompt with it",
        )
    return [(without, whole[len(without) :])]


def evaluate(lm, tasks: list[CoreTask]) -> dict | None:
    """{accuracy, centered, core, n} over the bundle's tasks with `lm` (a harness TemplateLM). Ranks split the
    examples (i on rank i % world); each rank sends all of a task's requests in one call, so a sharded model's
    lockstep forwards line up; the counts meet on rank 0 (None elsewhere)."""
    acc, centered, counts = {}, {}, {}
    for task in tasks:
        mine = list(range(lm.rank, len(task.examples), lm.world_size))
        flat, owner = [], []
        for i in mine:
            for option, (ctx, cont) in enumerate(requests(task, i, lm)):
                if (
                    ctx and cont
                ):  # an option whose tokens are all context (a choice that prefixes another): skipped
                    flat.append((None, ctx, cont))
                    owner.append((i, option, len(cont)))
        answers = lm._loglikelihood_tokens(flat, disable_tqdm=True)  # called even when empty: lockstep
        per: dict[int, dict[int, tuple[float, bool]]] = {i: {} for i in mine}
        for (i, option, n), (logprob, greedy) in zip(owner, answers, strict=True):
            per[i][option] = (-logprob / n, greedy)
        right = 0
        for i in mine:
            if task.kind == "language_modeling":
                right += int(per[i].get(0, (0.0, False))[1])
            elif per[i]:
                best = min(per[i], key=lambda o: per[i][o][0])  # the first of equal losses, as list.index
                right += int(best == task.examples[i]["gold"])
        total = lm.gather_object((right, len(mine)))
        if lm.rank != 0:
            continue
        r, n = (sum(x) for x in zip(*total, strict=True))
        acc[task.label] = r / n
        counts[task.label] = n
        centered[task.label] = (acc[task.label] - task.baseline) / (1 - task.baseline)
    if lm.rank != 0:
        return None
    return {
        "accuracy": acc,
        "centered": centered,
        "core": sum(centered.values()) / len(centered),
        "n": counts,
    }
