"""Every command README.md and docs/*.md show still works, by the rule in tests/docs_commands.py: each `loom`
command parses (its verb exists, its options and config overrides are accepted, its config passes validate),
the quick ones run here and exit 0 (the others run in tests/integration/test_docs_commands_run*.py), each
`make` target is a rule of the Makefile and each benchmark script exists; the table of commands not run and
the scale rule are checked here.

Parsing goes through loom's public entry, `loom.cli.main(argv)`, with argparse stopped just after the verb's
parser has read the command (`ArgumentParser.parse_args`), or, for the verbs that pass `--section.key=value`
on (`parse_known_args`: train, sft, verify, bench train, the dry run), after those overrides have been read
into a config by `loom.config.load_config`: nothing trains, nothing is read from a run. Compared against: the
command as the page prints it."""

import argparse
import re

import pytest
from docs_commands import (
    NOT_RUN,
    STEPS,
    TOP,
    all_commands,
    complete,
    inner_command,
    key,
    loom_argv,
    pages,
    runs,
    runs_as_process,
    runs_here,
    scale,
    with_env,
)
from docs_run_pages import PAGE_GROUPS

from loom import cli, config

COMMANDS = all_commands()
LOOM = [c for c in COMMANDS if loom_argv(c.words) is not None]


class Parsed(Exception):
    """The command got past its parser (and its config overrides): it parses."""


@pytest.fixture
def parse_only(monkeypatch):
    """argparse stops right after a verb's own parser has read its arguments."""
    plain_known = argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_args(self, args=None, namespace=None):
        inside.append(True)
        try:
            ns = argparse.ArgumentParser.__dict__["_loom_plain_parse_args"](self, args, namespace)
        finally:
            inside.pop()
        raise Parsed(ns)

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = plain_known(self, args, namespace)
        if inside:
            return ns, rest
        # The verb hands the rest on as config overrides: read them into a config as it would.
        cfg_file, rest = config.config_argv(list(args), getattr(ns, "config", None), rest)
        cfg = config.load_config(cfg_file, rest)
        # and the rules a config is held to before anything runs, over the processes it names (the
        # commands NOT_RUN keeps from running, too: docs/models.md's lr below min_lr was caught only by a run)
        world = getattr(ns, "world", None) or getattr(ns, "nproc", None) or 1
        config.validate(cfg, world=int(world))
        raise Parsed(ns)

    monkeypatch.setattr(
        argparse.ArgumentParser, "_loom_plain_parse_args", argparse.ArgumentParser.parse_args, raising=False
    )
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)


def _parses(argv, capsys):
    try:
        code = cli.main(argv)
    except Parsed:
        return
    except SystemExit as e:  # argparse: 0 after a help text, 2 after a usage error
        code = e.code
    if code not in (0, None):
        pytest.fail(f"loom {' '.join(argv)} does not parse (exit {code}):\n{capsys.readouterr().err}")


def test_the_pages_show_commands():
    assert len(LOOM) >= 80, "the extraction found too few loom commands in README.md and docs/*.md"


@pytest.mark.parametrize("cmd", LOOM, ids=lambda c: c.id)
def test_every_loom_command_parses(cmd, parse_only, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(TOP)  # configs/... as the pages give them
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    with_env(cmd.words, monkeypatch, TOP)
    argv = loom_argv(cmd.words)
    _parses(argv, capsys)
    if (inner := inner_command(argv)) is not None:
        _parses(inner, capsys)


def _quick(cmd):
    """A plan over more than 256 GPUs searches longer (20 s here): it runs, marked slow."""
    argv = loom_argv(cmd.words)
    gpus = int(argv[argv.index("--gpus") + 1]) if "--gpus" in argv else 0
    return pytest.param(cmd, marks=pytest.mark.slow) if gpus > 256 else cmd


@pytest.mark.parametrize("cmd", [_quick(c) for c in LOOM if runs_here(c)], ids=lambda c: c.id)
def test_quick_commands_run_and_exit_0(cmd, monkeypatch, capsys):
    monkeypatch.chdir(TOP)
    argv = loom_argv(cmd.words)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    assert code in (0, None), f"loom {' '.join(argv)} exited {code}:\n{out.err}"
    assert out.out.strip(), f"loom {' '.join(argv)} printed nothing"


def test_every_other_loom_command_runs_or_says_why_not():
    """Each loom command runs somewhere (here, the doctor's test, or the pages' test) or NOT_RUN gives why."""
    unaccounted = [
        c.id for c in LOOM if not (runs_here(c) or runs_as_process(c) or runs(c) or key(c) in NOT_RUN)
    ]
    assert not unaccounted, unaccounted


def _make_targets() -> set[str]:
    text = (TOP / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, flags=re.M))


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.words[0] == "make"], ids=lambda c: c.id)
def test_make_lines_name_real_targets(cmd):
    targets = [w for w in cmd.words[1:] if not w.startswith("-") and "=" not in w]
    assert targets, f"{cmd.id}: no target"
    missing = [t for t in targets if t not in _make_targets()]
    assert not missing, f"{cmd.id}: no Makefile rule for {missing}"


@pytest.mark.parametrize(
    "cmd", [c for c in COMMANDS if any(w.startswith("benchmarks/") for w in c.words)], ids=lambda c: c.id
)
def test_benchmark_scripts_exist(cmd):
    scripts = [w for w in cmd.words if w.startswith("benchmarks/") and w.endswith(".py")]
    assert all((TOP / s).is_file() for s in scripts), f"{cmd.id}: {scripts}"


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(TOP)))
def test_links_between_pages_resolve(page):
    """Every relative link of README.md and docs/*.md names a file that exists, and a heading it has."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            bad.append(target)
    assert not bad, f"{page.name}: links to nothing: {bad}"


def test_not_run_names_commands_the_pages_still_show():
    """docs_commands.NOT_RUN is the one table of commands the docs test does not run: each entry still names
    a command of its page (a changed command runs, or is listed again with its reason)."""
    shown = {key(c) for c in COMMANDS}
    assert not set(NOT_RUN) - shown, sorted(set(NOT_RUN) - shown)
    assert all(NOT_RUN.values())


def test_every_page_is_run_by_one_file():
    grouped = [p for group in PAGE_GROUPS.values() for p in group]
    assert sorted(grouped) == sorted(str(p.relative_to(TOP)) for p in pages())
    for name in PAGE_GROUPS:
        assert (TOP / "tests" / "integration" / name).is_file(), name


def test_the_scale_rule():
    """Fewer steps and nothing else: the steps capped (a page's k-th resume k x STEPS further), the checkpoint
    a later command reads renamed with them, the evaluation and sample cut; a benchmark one repetition."""
    assert scale(["train", "--model.n_layer=6", "--train.steps=3000"]) == [
        "train",
        "--model.n_layer=6",
        f"--train.steps={STEPS}",
        "--train.eval_batches=1",
        "--train.sample_tokens=8",
    ]
    assert f"--train.steps={STEPS}" in scale(["train"])
    assert f"--train.steps={3 * STEPS}" in scale(["train", "--resume", "--train.steps=6000"], 2)
    rl = scale(["rl", "--model.init_from=run:runs/sft/ckpt/step_000600", "--train.ckpt_every=600"])
    assert (
        f"--model.init_from=run:runs/sft/ckpt/step_{STEPS:06d}" in rl and f"--train.ckpt_every={STEPS}" in rl
    )
    assert scale(["train", "--help-config"]) == ["train", "--help-config"]
    assert scale(["bench", "train", "c.toml"])[-6:] == ["--steps", "1", "--warmup", "0", "--rounds", "1"]
    assert "--max-new-tokens=8" in scale(["generate", "runs/x", "--max-new-tokens", "200"])
    assert scale(["eval", "runs/x"]) == ["eval", "runs/x"]


def test_an_elided_command_is_the_one_above_it_with_its_options():
    page = [c for c in COMMANDS if c.page == "docs/post-training.md"]
    (lora,) = [c for c in page if c.elided and "--run.name=sft-lora" in c.words]
    argv = complete(lora, page)
    assert argv[0] == "sft" and "--data.path=data/chat" in argv and "--finetune.lora_rank=16" in argv
    assert argv[-1] == "--run.name=sft-lora"
