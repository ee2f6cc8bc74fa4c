"""Capability evaluation through lm-evaluation-harness: its tasks (any of its 14k, or the user's own YAMLs),
its prompts, metrics and table; loom's model answers the requests (loom.eval.lm_adapter.LoomLM).

    load_tasks(names, include_path, num_fewshot)   the tasks, their data read, before any model is loaded
    make_lm(model, tokenizer, device, ...)         the adapter (a whole model, or an FSDP-sharded one)
    evaluate(lm, tasks, limit)                     the harness's results (on rank 0; None elsewhere)
    scores(results)                                {"task/metric": value}: what metrics.jsonl records

Offline use: the harness reads task data through `datasets`. loom turns a task whose data cannot be had (no
network, HF_DATASETS_OFFLINE=1) into one error that names the dataset and says how to fetch it or point a task
YAML at a local copy. The faults of a task YAML are named as such before any model is read: a YAML that does
not parse (the harness's index skips it), a local data file that does not exist, a template naming a field the
documents lack, more few-shot examples than the task has documents to draw them from. A task YAML with `dataset_path: json` and
`dataset_kwargs: {data_files: ...}` needs no network at all (tests/unit/test_lm_eval.py makes such tasks).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from loom.errors import LoomError

EXTRA_HINT = "install the eval extra: pip install 'loom[eval]' (lm-evaluation-harness)"


def require() -> None:
    """lm-evaluation-harness importable, and quiet: its per-task notes and the datasets' progress bars would
    drown loom's output (its warnings and errors still show)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise LoomError(f"capability evaluation needs lm-evaluation-harness ({e})", hint=EXTRA_HINT) from None
    import logging

    import datasets

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    datasets.disable_progress_bars()


def split_names(tasks: str | list[str]) -> list[str]:
    names = tasks if isinstance(tasks, list) else tasks.split(",")
    return [n.strip() for n in names if n.strip()]


def _manager(names: list[str], include_path: str | None):
    """The harness's TaskManager, once every name is known (else the error naming the nearest). With
    --include-path holding every asked-for task, only that folder is indexed (the harness's own 14k task files
    take ~15 s to index); an unknown name is found from that folder and the harness's own index, before the
    two are indexed together."""
    from lm_eval.tasks import TaskManager

    known: set[str] = set()
    if include_path:
        p = Path(include_path)
        if not p.is_dir():
            raise LoomError(f"--include-path '{p}' is not a folder", hint="a folder of task YAML files")
        own = TaskManager(include_path=str(p), include_defaults=False)
        if all(n in own.all_tasks for n in names):
            return own
        known.update(own.all_tasks)
    known.update(_indexed(None).all_tasks)
    for n in names:
        if Path(n).is_file():
            check_yaml(Path(n))
        elif n not in known:
            _no_task(n, known, include_path)
    return _indexed(include_path)


def _indexed(include_path: str | None):
    """The harness's index with the tasks under include_path, made once per process (an in-loop evaluation
    reads its tasks once anyway)."""
    from lm_eval.tasks import TaskManager

    key = str(include_path or "")
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=include_path)
    return _MANAGERS[key]


_MANAGERS: dict[str, object] = {}


def load_tasks(tasks: str | list[str], include_path: str | None = None, num_fewshot: int | None = None):
    """The harness's TaskDict for `tasks` (names of tasks, groups or tags), each task's data read now.
    An unknown name gets the nearest known ones; data that cannot be read gets what to fetch."""
    require()
    names = split_names(tasks)
    if not names:
        raise LoomError("no task names given", hint="e.g. --tasks hellaswag,arc_easy,piqa")
    tm = _manager(names, include_path)
    built = []
    for n in names:
        obj = _load_one(tm, n)
        built.extend(obj if isinstance(obj, list) else [obj])  # a tag is a list of tasks
    loaded = tm.load(built)
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=1234)  # the harness's default fewshot seed
    check_fewshot(loaded, num_fewshot)
    return loaded


def _yaml_problem(path: Path) -> str | None:
    """Why a task YAML does not parse (its line and column), else None. The harness's `!function` tags are
    accepted unresolved, as its index reads them."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        with open(path, "rb") as f:
            data = yaml.load(f, Loader=Loader)  # noqa: S506 - a SafeLoader whose tags build nothing
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{getattr(e, 'problem', None) or e}{at}"
    except (OSError, UnicodeDecodeError) as e:
        return f"it cannot be read ({e})"
    return None if isinstance(data, dict) else f"it holds {type(data).__name__}, not keys and values"


def check_yaml(path: Path) -> None:
    """Refuse a task YAML that does not parse, naming the file and the place."""
    problem = _yaml_problem(path)
    if problem:
        raise LoomError(f"the task YAML '{path}' does not parse: {problem}", hint="fix the YAML")


def _no_task(name: str, known: set[str], include_path: str | None) -> None:
    """The error for a task name nobody knows: a YAML under --include-path that does not parse is the likely
    cause (the harness's index skips it without a word), else the nearest known names."""
    broken = []
    if include_path:
        for path in sorted(Path(include_path).rglob("*.yaml")):
            problem = _yaml_problem(path)
            if problem:
                broken.append((name in path.read_text(encoding="utf-8", errors="replace"), path, problem))
    broken.sort(key=lambda b: not b[0])  # the file that mentions the name first
    if broken:
        _, path, problem = broken[0]
        more = f" (and {len(broken) - 1} other YAML(s) there)" if len(broken) > 1 else ""
        raise LoomError(
            f"lm-evaluation-harness has no task '{name}': the task YAML '{path}' under --include-path does not "
            f"parse{more}: {problem}",
            hint="fix the YAML (the harness leaves out a file it cannot parse)",
        )
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    raise LoomError(
        f"lm-evaluation-harness has no task '{name}'"
        + (f": did you mean {', '.join(repr(c) for c in close)}?" if close else ""),
        hint="`lm-eval ls tasks` lists them; a task of your own: its YAML in a folder given with --include-path",
    )


def check_fewshot(loaded, num_fewshot: int | None = None) -> None:
    """Refuse, before any scoring, a few-shot count larger than the documents a task draws its examples from
    (the harness's sampler failed mid-evaluation with 'Sample larger than population')."""
    for name, task in loaded["tasks"].items():
        n = task.get_config("num_fewshot") or 0
        if n <= 0:
            continue
        sampler = getattr(task, "sampler", None)
        pool = len(sampler.fewshot_docs()) if sampler is not None else 0
        # examples drawn from the evaluated split leave out the document being evaluated
        split = getattr(getattr(task, "fewshot_cfg", None), "split", None)
        own = int(split is not None and split == task.get_config("test_split"))
        if n > pool - own:
            asked = f"--num-fewshot {n}" if num_fewshot is not None else f"num_fewshot {n} (the task's own)"
            raise LoomError(
                f"{asked}: task '{name}' has {pool - own} document(s) to draw few-shot examples from"
                + (" (its split less the document evaluated)" if own else ""),
                hint=f"give --num-fewshot {max(0, pool - own)} or less",
            )


def check_encodable(loaded, tokenizer, limit: int | None = None) -> None:
    """A character-table tokenizer cannot encode characters its corpus never had: refuse, before any scoring
    (and before training when the loop evaluates), a task whose prompts hold one (byte-level BPE encodes any
    text, so only a character table is checked)."""
    from loom.data.tokenizers import CharTokenizer

    if not isinstance(tokenizer, CharTokenizer):
        return
    for name, task in loaded["tasks"].items():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        for inst in task.instances:
            for text in inst.args:
                if not isinstance(text, str):
                    continue  # generation settings
                try:
                    tokenizer.encode(text)
                except LoomError as e:
                    raise LoomError(
                        f"task '{name}', document {inst.doc_id}: {e.message}",
                        hint="the run's tokenizer is a character table of its training text: score tasks in its "
                        "characters, or train on data prepared with --tokenizer bpe",
                    ) from None


def _load_one(tm, name: str):
    """Build one task or group (its data read now), or say what data it needs."""
    try:
        obj = tm._load_spec(name)
    except LoomError:
        raise
    except Exception as e:  # datasets raises its own types (ConnectionError, DatasetNotFoundError, ...)
        entry = tm.task_index.get(name)
        where = f" ({entry.yaml_path})" if entry is not None and getattr(entry, "yaml_path", None) else ""
        _check_task_spec(name, where, getattr(entry, "cfg", None) or {}, e)
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        raise LoomError(
            f"the data of task '{name}'{where} cannot be read{' offline' if offline else ''}: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
            hint='on a machine with network, load it once with the harness (python -c "import lm_eval.tasks as t; '
            f"t.TaskManager().load('{name}')\") and copy the datasets cache (~/.cache/huggingface/datasets, "
            "or HF_DATASETS_CACHE) here; or write the task's YAML with dataset_path: json and "
            "dataset_kwargs: {data_files: <local JSONL>} and give its folder with --include-path",
        ) from None
    return obj


def _local_files(value) -> list[str]:
    """The paths named by a task's dataset_kwargs.data_files (a path, a list, or {split: path or list})."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [p for v in value for p in _local_files(v)]
    if isinstance(value, dict):
        return [p for v in value.values() for p in _local_files(v)]
    return []


def _check_task_spec(name: str, where: str, cfg: dict, e: Exception) -> None:
    """A task that failed to load for a fault of its YAML, not for data out of reach: a local data file that
    does not exist, or a template naming a field the documents lack. Each named, instead of 'cannot be read'."""
    kwargs = cfg.get("dataset_kwargs") if isinstance(cfg.get("dataset_kwargs"), dict) else {}
    for f in _local_files(kwargs.get("data_files")):
        if "://" not in f and not any(c in f for c in "*?[") and not Path(f).expanduser().exists():
            here = "" if Path(f).expanduser().is_absolute() else f" (from the current folder '{Path.cwd()}')"
            raise LoomError(
                f"task '{name}'{where}: its data file '{f}' does not exist{here}",
                hint="fix dataset_kwargs.data_files in the task's YAML (a relative path is read from the "
                "current folder)",
            )
    import jinja2

    if isinstance(e, jinja2.TemplateError):
        fields = [k for k, v in cfg.items() if k.startswith("doc_to_") and isinstance(v, str) and "{" in v]
        raise LoomError(
            f"task '{name}'{where}: a template of the task fails on its documents: {type(e).__name__}: {e}",
            hint=f"its templates ({', '.join(fields) or 'doc_to_text, doc_to_target, doc_to_choice'}) may name "
            "only the fields of the task's documents",
        )


def make_lm(
    model,
    tokenizer,
    device,
    *,
    batch_size: int = 16,
    autocast=None,
    rank: int = 0,
    world_size: int = 1,
    sharded: bool = False,
    all_reduce_sum=None,
):
    """The harness's LM over loom's model: `world_size` ranks split the requests; `sharded` (FSDP): their
    forwards in lockstep, agreeing through `all_reduce_sum` (default: torch.distributed's)."""
    require()
    import contextlib

    from loom.eval.lm_adapter import LoomLM
    from loom.eval.scoring import Scorer

    if tokenizer is None:
        raise LoomError(
            "the run was trained on data without a tokenizer: the harness's text cannot be turned into ids",
            hint="train on data prepared by loom (or nanogpt data with meta.pkl)",
        )
    if getattr(tokenizer, "eot_id", None) is None:
        raise LoomError(
            "the run's tokenizer has no end-of-text token, which the harness puts before an empty context and "
            "CORE before every prompt",
            hint="evaluate a run whose data was prepared by loom (its tokenizers always have one)",
        )
    if tokenizer.eot_id >= model.cfg.vocab_size:
        raise LoomError(
            f"the tokenizer's end-of-text id {tokenizer.eot_id} is outside the model's vocabulary of "
            f"{model.cfg.vocab_size}: the model never saw an end-of-text token (nanogpt's character data has none)",
            hint="the harness puts it before an empty context and CORE before every prompt: score a model "
            "trained on data prepared by loom (every document ends with it)",
        )
    scorer = Scorer(
        model,
        device,
        tokenizer.eot_id,
        batch_size=batch_size,
        autocast=autocast or contextlib.nullcontext,
        lockstep=(all_reduce_sum or _sum_over_ranks) if sharded and world_size > 1 else None,
    )
    return LoomLM(scorer, tokenizer, rank=rank, world_size=world_size)


def _sum_over_ranks(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def evaluate(lm, loaded, limit: int | float | None = None, bootstrap_iters: int = 0) -> dict | None:
    """The harness's evaluation of `loaded` (load_tasks) with `lm`: its results dict on rank 0, None elsewhere.
    Each call builds the requests anew, so the same tasks can be evaluated at every step of a run.
    bootstrap_iters: 0 (default) computes no stderrs. With N > 0 the harness gives means (acc, exact_match)
    their closed-form stderr and bootstraps the others (perplexities, bits per byte) in a multiprocessing.Pool
    forked from this process; a fork of a process that runs other threads (torch, tokenizers, pyarrow) hung in
    make test, so loom asks for it only when the user does (loom eval --bootstrap-iters)."""
    from lm_eval.evaluator import evaluate as run

    return run(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)


def scores(results: dict) -> dict[str, float]:
    """{"task/metric": value} of every numeric metric (filter suffixes and stderrs dropped)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if metric.endswith("_stderr") or metric == "alias" or not isinstance(value, int | float):
                continue
            out[f"{task}/{metric}"] = float(value)
    return out


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text
