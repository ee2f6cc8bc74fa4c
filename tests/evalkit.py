"""Task data the capability-evaluation tests make themselves (never downloaded): lm-evaluation-harness task
YAMLs over local JSONL (a multiple-choice, a schema, a loglikelihood, a generate-until and a rolling-perplexity
task) and a CORE eval bundle (multiple choice, schema, language modelling), in words any BPE tokenizer encodes."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tiny import tiny_args

WORDS = "the of and to in is that it for as with was on be by at this from have or an they which one you were".split()
TASKS = "evkit_mc,evkit_schema,evkit_lm,evkit_gen,evkit_roll"
# the model the capability-evaluation tests train (64 positions: room for the tasks' prompts)
TINY = tiny_args(
    {
        "model.n_embd": 48,
        "model.block_size": 64,
        "train.eval_batches": 1,
        "optim.warmup_steps": 2,
        "train.log_every": None,
    }
)


def _sent(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def prepare_data(root: Path, n_docs: int = 6, words: int = 2400) -> Path:
    """BPE-prepared data of sentences in WORDS (the tasks' words): returns the data folder."""
    from loom.data.prepare import prepare

    rng = random.Random(7)
    docs = Path(root) / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = "".join(
            _sent(rng, rng.randint(4, 12)).capitalize() + rng.choice([". ", ".\n"]) for _ in range(words // 8)
        )
        (docs / f"d{i}.txt").write_text(text, encoding="utf-8")
    prepare([docs], Path(root) / "data", tokenizer="bpe", vocab_size=400, val_fraction=0.2, seed=0)
    return Path(root) / "data"


def write_tasks(root: Path, n: int = 24, seed: int = 0) -> Path:
    """A folder of harness tasks (give it as --include-path); returns the folder."""
    rng = random.Random(seed)
    d = Path(root) / "tasks"
    d.mkdir(parents=True, exist_ok=True)
    data = {
        "mc": [
            {
                "question": _sent(rng, 8),
                "choices": [_sent(rng, rng.randint(1, 3)) for _ in range(4)],
                "label": rng.randrange(4),
            }
            for _ in range(n)
        ],
        "schema": [
            {
                "contexts": [_sent(rng, 6) for _ in range(2)],
                "continuation": _sent(rng, 3),
                "label": rng.randrange(2),
            }
            for _ in range(n)
        ],
        "lm": [{"context": _sent(rng, 10), "target": _sent(rng, 1)} for _ in range(n)],
        "gen": [{"question": _sent(rng, 6), "answer": _sent(rng, 2)} for _ in range(n // 2)],
    }
    for name, rows in data.items():
        _jsonl(d / f"{name}.jsonl", rows)

    def head(task: str, data_name: str) -> str:
        return (
            f"task: evkit_{task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {(d / data_name).resolve()}.jsonl\ntest_split: test\n"
        )

    (d / "mc.yaml").write_text(
        head("mc", "mc") + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    # schema (winogrande's shape): the contexts are the options, the continuation is shared
    (d / "schema.yaml").write_text(
        head("schema", "schema") + 'output_type: multiple_choice\ndoc_to_text: "{{label}}"\n'
        'doc_to_choice: "{{contexts}}"\ndoc_to_target: " {{continuation}}"\nmetric_list:\n  - metric: acc\n'
    )
    (d / "lm.yaml").write_text(
        head("lm", "lm") + 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
        'doc_to_target: " {{target}}"\nmetric_list:\n  - metric: perplexity\n  - metric: acc\n'
    )
    (d / "gen.yaml").write_text(
        head("gen", "gen") + 'output_type: generate_until\ndoc_to_text: "{{question}} is"\n'
        'doc_to_target: " {{answer}}"\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n'
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    (d / "roll.yaml").write_text(
        head("roll", "mc") + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
        'doc_to_target: "{{question}}"\nmetric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n'
    )
    return d


def write_bundle(root: Path, n: int = 24, seed: int = 1) -> Path:
    """A CORE eval bundle (core.yaml, eval_meta_data.csv, eval_data/); returns its folder."""
    rng = random.Random(seed)
    b = Path(root) / "bundle"
    (b / "eval_data").mkdir(parents=True, exist_ok=True)
    _jsonl(
        b / "eval_data" / "mc.jsonl",
        [
            {
                "query": _sent(rng, 6),
                "choices": [_sent(rng, rng.randint(1, 3)) for _ in range(4)],
                "gold": rng.randrange(4),
            }
            for _ in range(n)
        ],
    )
    _jsonl(
        b / "eval_data" / "schema.jsonl",
        [
            {
                "context_options": [_sent(rng, 5) for _ in range(2)],
                "continuation": _sent(rng, 3),
                "gold": rng.randrange(2),
            }
            for _ in range(n)
        ],
    )
    _jsonl(
        b / "eval_data" / "lm.jsonl",
        [{"context": _sent(rng, 8) + " ", "continuation": _sent(rng, 1)} for _ in range(n)],
    )
    (b / "core.yaml").write_text(
        "icl_tasks:\n"
        "- label: kit_mc\n  dataset_uri: mc.jsonl\n  num_fewshot: [3]\n  icl_task_type: multiple_choice\n"
        "- label: kit_schema\n  dataset_uri: schema.jsonl\n  num_fewshot: [2]\n  icl_task_type: schema\n"
        "- label: kit_lm\n  dataset_uri: lm.jsonl\n  num_fewshot: [1]\n  icl_task_type: language_modeling\n"
        "  continuation_delimiter: ' '\n"
    )
    (b / "eval_meta_data.csv").write_text(
        "Eval Task,Task Category,Task Type,#shots,Random baseline\n"
        "kit_mc,toy,multiple choice,3,25.0\nkit_schema,toy,schema,2,50.0\nkit_lm,toy,language modeling,1,0.0\n"
    )
    return b


def torchrun_loom(*args: str, nproc: int = 2, timeout: float = 300):
    """`torchrun --nproc-per-node N -m loom ARGS` (gloo, one thread per process), which must exit 0."""
    import os
    import shutil
    import subprocess
    import sys

    from loom.env import free_port

    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [exe, "--nproc-per-node", str(nproc), "--master-port", str(free_port()), "--no-python"]
    r = subprocess.run(
        [*cmd, sys.executable, "-m", "loom", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r
