"""`loom serve RUN --nproc 2`: a chat run trained under tensor parallel (tp=2 with sequence parallel) served split
over two processes, rank 0 answering, against the same run served by one process (the same app in a thread of
this process), both through the official `openai` client: greedy chat and completion answers, a streamed answer,
n=2 seeded samples equal; log-probabilities within 1e-5; SIGTERM to the launcher with an answer in flight
drains it and every rank exits 0 once the ranks agree on every answer (loom.serve.tp). And what it refuses
before loading anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from loomrun import loom_here

from loom.cli import main
from loom.env import detect_env
from loom.runs import open_run
from loom.serve import ServeOptions, served_for, serving_in_thread

PROMPT = "reverse: apple river"


@pytest.fixture(scope="module")
def tp_run(sft):
    """A chat run fine-tuned from the base run under tp=2 with sequence parallel (its checkpoint tp-sharded)."""
    from sftkit import _sft_args

    args = _sft_args(sft, "chat-tp", "--train.steps=6", "--parallel.tp=2", "--parallel.sp=true")
    loom_here(*args[:1], "--nproc", "2", *args[1:])
    return sft / "runs" / "chat-tp"


@pytest.fixture(scope="module")
def one(tp_run):
    """The run served by one process (a thread of this one): an openai client."""
    with open_run(tp_run, torch.device("cpu"), detect_env()) as run:
        with serving_in_thread(served_for(run, tp_run, ServeOptions(max_seqs=8))) as port:
            yield openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
            )


@pytest.fixture(scope="module")
def split(tp_run, tmp_path_factory):
    """`loom serve RUN --nproc 2` (a process of its own, its log in a file): (process, client, log path)."""
    log = tmp_path_factory.mktemp("serve_tp") / "serve.log"
    command = [sys.executable, "-m", "loom", "serve", str(tp_run), "--nproc", "2", "--port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*command, "--device", "cpu", "--max-seqs", "8", "--grace", "20"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        url = _served_url(proc, log)
        yield proc, openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60), log
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _served_url(proc: subprocess.Popen, log, timeout: float = 240) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in log.read_text().splitlines():
            if "loom serve:" in line and "http://" in line:
                return "http://" + line.split("http://")[1].split()[0]  # .../v1
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError("loom serve --nproc 2 printed no address:\n" + log.read_text())


def chat(client, **kw):
    return client.chat.completions.create(
        model="chat-tp", messages=[{"role": "user", "content": PROMPT}], **{"max_tokens": 20, **kw}
    )


def complete(client, **kw):
    return client.completions.create(model="chat-tp", prompt="apple ", **{"max_tokens": 16, **kw})


def test_greedy_answers_equal_one_process(split, one):
    _, tp, _ = split
    assert (
        chat(tp, temperature=0).choices[0].message.content
        == chat(one, temperature=0).choices[0].message.content
    )
    assert complete(tp, temperature=0).choices[0].text == complete(one, temperature=0).choices[0].text


def test_streamed_answer_is_one_process_answer(split, one):
    chunks = list(chat(split[1], temperature=0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == chat(one, temperature=0).choices[0].message.content


def test_n2_seeded_samples_equal_one_process(split, one):
    tp = chat(split[1], temperature=1.0, n=2, seed=7, max_tokens=12)
    assert [c.message.content for c in tp.choices] == [
        c.message.content for c in chat(one, temperature=1.0, n=2, seed=7, max_tokens=12).choices
    ]
    # unseeded, rank 0 gives the request a seed of its own: every rank draws the same (the digest at the end)
    assert len(chat(split[1], temperature=1.0, n=3).choices) == 3


def test_logprobs_close_to_one_process(split, one):
    tp, ref = (complete(c, temperature=0, logprobs=3).choices[0] for c in (split[1], one))
    assert tp.logprobs.tokens == ref.logprobs.tokens
    diff = max(
        abs(a - b) for a, b in zip(tp.logprobs.token_logprobs, ref.logprobs.token_logprobs, strict=True)
    )
    assert diff < 1e-5, diff


def test_a_client_that_leaves_mid_stream_is_cancelled_on_every_rank(split, one):
    stream = chat(split[1], temperature=0, stream=True, max_tokens=36)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    # the cancellation reached every rank at the same step (the digest at the end compares their answers)
    want = chat(one, temperature=0).choices[0].message.content
    assert chat(split[1], temperature=0).choices[0].message.content == want


def test_a_bad_request_never_stops_the_ranks(split, one):
    """A seed outside 64 bits once killed rank 0's engine thread (the ranks 'lost each other'): now 400, and
    the split server answers on, the same as one process (issue 57)."""
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as e:
            complete(split[1], seed=seed, max_tokens=3)
        assert e.value.param == "seed"
    top = complete(split[1], seed=2**64 - 1, n=2, max_tokens=6)  # choice 1's seed wraps to 0
    assert [c.text for c in top.choices] == [
        c.text for c in complete(one, seed=2**64 - 1, n=2, max_tokens=6).choices
    ]
    assert complete(split[1], temperature=0).choices[0].text == complete(one, temperature=0).choices[0].text


def test_sigterm_drains_and_every_rank_exits_0(split, one):
    """Last (the module's server ends here): an answer in flight when the launcher gets SIGTERM completes."""
    proc, tp, log = split
    started = threading.Event()

    def long_stream() -> tuple[str, str]:
        text, reason = "", None
        for c in chat(tp, temperature=0, stream=True, max_tokens=36):
            if c.choices:
                started.set()
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(long_stream)
        assert started.wait(timeout=60)
        proc.send_signal(signal.SIGTERM)
        text, reason = answer.result(timeout=60)
    whole = chat(one, temperature=0, max_tokens=36).choices[0]
    assert (text, reason) == (whole.message.content, whole.finish_reason)
    assert proc.wait(timeout=90) == 0, log.read_text()  # the launcher waited for both ranks, each exited 0
    out = log.read_text()
    assert "the 2 ranks agree on all" in out and "loom serve: stopped" in out, out


def _load_tp(rank: int, world: int, run_dir: str, ids, out: str) -> None:
    """A rank of load_run_tp that may not read the whole checkpoint: rank 0 saves the gathered logits."""
    from dataclasses import replace

    import loom.runs as runs
    from loom.parallel.tensor import whole

    def whole_read(*args, **kwargs):
        raise AssertionError("load_run_tp read the whole checkpoint")

    runs.load_run = whole_read
    env = replace(detect_env(), rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    _, model, _, _, path = runs.load_run_tp(run_dir, torch.device("cpu"), env)
    with torch.no_grad():
        logits = whole(model(ids))
    if rank == 0:
        torch.save((logits, str(path)), out)


@pytest.mark.parametrize("which", ["tp-trained", "one-process"])
def test_each_rank_reads_only_its_slices_of_the_checkpoint(tp_run, sft, tmp_path, which):
    """load_run_tp reads a DCP checkpoint's shards (not load_run's whole read), whatever layout wrote it: the
    tp=2+sp chat run and the base run trained by one process; the split model's logits equal one process's."""
    from gloo_ranks import spawn_gloo

    run = tp_run if which == "tp-trained" else sft / "runs" / "base"
    ids = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(0))
    with open_run(run, torch.device("cpu"), detect_env()) as one_run, torch.no_grad():
        want = one_run.model(ids)
        newest = one_run.path
    spawn_gloo(_load_tp, 2, tmp_path, str(run), ids, str(tmp_path / "logits.pt"))
    got, path = torch.load(tmp_path / "logits.pt")
    assert path == str(newest)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_split_the_heads_do_not_allow_is_refused_before_loading(tp_run, capsys):
    assert main(["serve", str(tp_run), "--nproc", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot split" in err and "does not divide model.n_head=2" in err and "hint:" in err


def test_nproc_inside_a_job_is_refused(tp_run, capsys, monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", str(tp_run), "--nproc", "2", "--device", "cpu"]) == 2
    assert "already rank 0 of a job of 2" in capsys.readouterr().err
