"""What `--help` tells a newcomer: each `loom data` verb and each benchmark on a line of its own, `loom train`'s
dry-run options, a help text for every `loom generate`/`loom chat` option, one exit code for running out of
memory in --help-config and docs/operations.md, and the launcher named as the one that started the process.
Compared against: the verbs each command dispatches (loom.cli.data.DATA_VERBS, loom.cli.tools.BENCHES), the
options argparse lists, loom.errors.EXIT_OUT_OF_MEMORY and the variables each launcher sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loom.cli import main
from loom.cli.data import DATA_VERBS
from loom.cli.tools import BENCHES
from loom.env import detect_env
from loom.errors import EXIT_OUT_OF_MEMORY

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def undocumented(text: str) -> list[str]:
    """The options of an argparse help text listed without a description (an option line with nothing after
    its name and metavar, and no indented continuation below it)."""
    lines = text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-{1,2}[\w-]+(?: [A-Z_]+)?(?:, -{1,2}[\w-]+(?: [A-Z_]+)?)*)(\s{2,}\S.*)?$", line)
        if not m or m.group(2):
            continue
        below = lines[i + 1] if i + 1 < len(lines) else ""
        if not re.match(r"^ {8,}\S", below):
            bare.append(m.group(1))
    return bare


def test_data_help_lists_every_verb(capsys):
    out = _help(capsys, "data")
    assert set(DATA_VERBS) == {"prepare", "convert", "inspect", "tokenizer"}
    for verb in DATA_VERBS:
        assert re.search(rf"^    {verb}\s+\S", out, re.M), (verb, out)  # its own line, with what it does
    for verb in ("convert", "inspect"):  # each verb's own --help still answers
        assert f"loom data {verb}" in _help(capsys, "data", verb)


def test_bench_help_describes_each_benchmark(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert set(BENCHES) == {"comm", "optim", "peak", "train", "generate"}
    for name, (_, doc) in BENCHES.items():
        assert re.search(rf"^  {name}\s+{re.escape(doc)}$", out, re.M), (name, out)
    assert main(["bench"]) == 2 and "peak" in capsys.readouterr().err  # no benchmark named: the usage, exit 2


def test_train_help_shows_the_dry_run(capsys):
    out = _help(capsys, "train")
    assert "--dry-run" in out and "--world N" in out
    assert undocumented(out) == []
    assert main(["train", "--world", "8"]) == 2
    assert "--world is an option of --dry-run" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_every_sampling_option_has_help(capsys, verb):
    out = _help(capsys, verb)
    assert "--temperature" in out and "--top-p" in out
    assert undocumented(out) == [], out
    assert not re.search(r"^  run_dir\s*$", out, re.M)  # the positional too


def test_undocumented_finds_a_bare_option():
    text = "options:\n  --seed SEED\n  --device DEVICE  where\n  --top-p TOP_P\n                 nucleus\n"
    assert undocumented(text) == ["--seed SEED"]


def test_out_of_memory_exit_code_agrees(capsys):
    """--help-config said 75 (the stop signal's code) for train.memory_snapshot=on_oom; the docs say 71."""
    assert main(["train", "--help-config"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the help folds its lines
    said = re.findall(r"exit with code (\d+)", text)
    assert said == [str(EXIT_OUT_OF_MEMORY)], said
    ops = " ".join((DOCS / "operations.md").read_text().split())
    assert f"{EXIT_OUT_OF_MEMORY} out of device memory" in ops


@pytest.mark.parametrize(
    "variables, launcher",
    [
        ({"TORCHELASTIC_RUN_ID": "j1", "LOOM_NPROC_JOB": "j1"}, "loom --nproc"),
        ({"TORCHELASTIC_RUN_ID": "j2", "LOOM_NPROC_JOB": "j1"}, "torchrun"),  # torchrun below a loom worker
        ({"TORCHELASTIC_RUN_ID": "j2"}, "torchrun"),
        ({}, "env:// (RANK and WORLD_SIZE set by hand)"),
    ],
)
def test_the_launcher_is_the_one_that_started_the_process(variables, launcher):
    env = detect_env(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **variables}
    )
    assert env.source == "torchrun"  # the variables' dialect, which the code reads
    assert env.launched_by == launcher and f"({launcher})" in str(env)
