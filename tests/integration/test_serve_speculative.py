"""`loom serve` and `loom generate` with a prefix cache, speculative decoding and int8 weights, against the
same run served and sampled without them: the official `openai` client's greedy completions of prompts that
share a system prompt are the same texts from 12 concurrent clients (prompt lookup, a draft run, the prefix
cache), the engine counts the reused prefixes and drafted tokens, `loom generate --speculate/--draft` prints
what it prints without, and a draft run with another vocabulary is refused before anything loads."""

from __future__ import annotations

import contextlib
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from loom.cli import main
from loom.engine.speculative import DraftProposer, NgramProposer
from loom.env import detect_env
from loom.runs import load_run, open_run
from loom.serve import ServeOptions, served_for, serving_in_thread

# the base run's characters only (tests/sftkit.py's words): 37 characters, 2 blocks of 16 shared
SYSTEM = "reverse: apple river stone cloud red "
WORDS = "apple river stone cloud green house music paper light table".split()


@pytest.fixture(scope="module")
def runs(sft, tmp_path_factory):
    """The tiny base run, a draft run of the same tokenizer (other weights), and a copy of the base run whose
    tokenizer has another vocabulary."""
    from sftkit import MODEL, QUIET

    root = sft
    args = [f"--data.path={root / 'text'}", f"--run.dir={root / 'runs'}", "--run.name=draft", *MODEL, *QUIET]
    assert main(["train", *args, "--train.steps=2", "--run.seed=7", "--model.n_layer=1"]) == 0
    other = tmp_path_factory.mktemp("other")
    (other / "t.txt").write_text("xyz " * 200, encoding="utf-8")
    assert (
        main(
            [
                "data",
                "prepare",
                "--input",
                str(other / "t.txt"),
                "--out",
                str(other / "d"),
                "--tokenizer",
                "char",
            ]
        )
        == 0
    )
    shutil.copytree(root / "runs" / "base", other / "run")
    shutil.rmtree(other / "run" / "tokenizer")
    shutil.copytree(other / "d", other / "run" / "tokenizer")
    return root / "runs" / "base", root / "runs" / "draft", other / "run"


@contextlib.contextmanager
def serving(run_dir, **options):
    with open_run(run_dir, torch.device("cpu"), detect_env()) as run:
        with serving_in_thread(served_for(run, run_dir, ServeOptions(max_seqs=8, **options))) as port:
            yield f"http://127.0.0.1:{port}"


def answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

    def one(k: int) -> str:
        prompt = SYSTEM + WORDS[k % 10] + " " + WORDS[k // 10]
        got = client.completions.create(model="base", prompt=prompt, max_tokens=10, temperature=0)
        return got.choices[0].text

    with ThreadPoolExecutor(12) as pool:
        return list(pool.map(one, range(24)))


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_served_answers_are_the_same_with_a_prefix_cache_and_speculation(runs):
    base, draft, _ = runs
    with serving(base, prefix_cache_tokens=0) as url:
        want = answers(url)
        assert metric(url, "loom_prefix_cache_hits_total") == 0
    with serving(base) as url:  # the prefix cache is on by default
        assert answers(url) == want
        assert metric(url, "loom_prefix_cache_hits_total") > 0
        assert metric(url, "loom_prefix_cache_tokens_total") >= 32
    with serving(base, speculator=NgramProposer(), spec_tokens=3) as url:
        assert answers(url) == want
        assert metric(url, "loom_spec_proposed_tokens_total") > 0
    _, model, _, _, _ = load_run(draft, torch.device("cpu"))
    with serving(base, speculator=DraftProposer(model)) as url:
        assert answers(url) == want
        assert metric(url, "loom_spec_accepted_tokens_total") <= metric(
            url, "loom_spec_proposed_tokens_total"
        )
        assert metric(url, "loom_spec_proposed_tokens_total") > 0


def test_loom_generate_speculates_the_tokens_it_samples_without(runs, capsys):
    base, draft, _ = runs
    argv = ["generate", str(base), "--prompt", SYSTEM, "--max-new-tokens", "20", "--temperature", "0"]
    outs = []
    for extra in ([], ["--speculate", "ngram"], ["--draft", str(draft), "--spec-tokens", "2"]):
        assert main([*argv, *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and outs[0].startswith(SYSTEM)
    assert main([*argv, "--quantize", "int8"]) == 0
    assert capsys.readouterr().out.startswith(SYSTEM)


def test_a_draft_with_another_vocabulary_is_refused_before_anything_loads(runs, capsys):
    base, draft, other = runs
    for cmd in (["generate", str(base)], ["serve", str(base), "--port", "0"]):
        assert main([*cmd, "--draft", str(other)]) == 2
        err = capsys.readouterr().err
        assert f"--draft {other} has another vocabulary" in err and "tokenizer" in err
    assert main(["generate", str(base), "--speculate", "ngram", "--draft", str(draft)]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["serve", str(base), "--nproc", "2", "--quantize", "int8"]) == 2
    assert "not with --nproc" in capsys.readouterr().err
    assert main(["generate", str(base), "--spec-tokens", "0", "--speculate", "ngram"]) == 2


def test_loom_generate_drafts_with_the_runs_own_mtp_modules(runs, sft, capsys):
    from sftkit import MODEL, QUIET

    base = runs[0]
    args = [f"--data.path={sft / 'text'}", f"--run.dir={sft / 'runs'}", "--run.name=mtp", *MODEL, *QUIET]
    assert main(["train", *args, "--train.steps=2", "--model.mtp_depth=2"]) == 0
    capsys.readouterr()  # (training's own lines)
    argv = ["generate", str(sft / "runs" / "mtp"), "--prompt", SYSTEM, "--max-new-tokens", "12"]
    outs = []
    for extra in ([], ["--speculate", "mtp"]):
        assert main([*argv, "--temperature", "0", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].startswith(SYSTEM)
    assert main(["generate", str(base), "--speculate", "mtp", "--temperature", "0"]) == 2  # no MTP modules
    assert "has none" in capsys.readouterr().err
