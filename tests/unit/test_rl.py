"""`loom rl` end to end on one process (full and LoRA), the sampler's log-probabilities against the trainer's,
exact resume, and RL's bad inputs.

Compared against: the trainer's own forward (the log-probability of each sampled token from a training forward
of the whole sequences, fp32), an uninterrupted run (a run stopped and resumed gives the same rewards and
losses), and the contract for bad input (a LoomError that names the cause, before any step)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from rlkit import QUIET, rl_args

from loom.cli import main
from loom.errors import LoomError

REGEX = ["--rl.reward=regex", "--rl.pattern=1"]  # an answer holding a 1: rewards that vary inside a group


def _records(run_dir) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out.append(r)
    return out


def _heldout(run_dir) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "rl/pass@1" in r]


def test_rl_trains_and_records_its_figures(rl_root, capsys):
    held = f"--rl.eval_prompts={rl_root / 'arith' / 'rl_heldout.jsonl'}"
    args = rl_args(rl_root, "full", *REGEX, "--train.steps=3", held, "--rl.eval_k=2", "--rl.eval_every=2")
    assert main(args) == 0
    out = capsys.readouterr().out
    recs = _records(rl_root / "runs" / "full")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for key in (
            "rl/reward_mean",
            "rl/reward_std",
            "rl/response_len",
            "rl/entropy",
            "rl/clip_frac",
            "rl/dropped_groups",
            "rl/logprob_diff",
            "rl/rollout_tokens_per_s",
            "rl/train_tokens_per_s",
        ):
            assert key in r, key
        assert 0 <= r["rl/reward_mean"] <= 1 and r["rl/response_len"] <= 5  # 4 tokens + the end of turn
        assert r["rl/logprob_diff"] < 1e-5  # fp32: the sampler's and the trainer's log-probabilities
    assert any(r["rl/trained_tokens"] > 0 and r["grad_norm"] > 0 for r in recs)
    held_recs = _heldout(rl_root / "runs" / "full")
    assert [r["step"] for r in held_recs] == [0, 2, 3]  # step 0: the start model's, the baseline
    assert all(0 <= r["rl/pass@1"] <= r["rl/pass@2"] + 1 for r in held_recs)
    # issue 58 item 6: tokens/s (and MFU) count the trained answer tokens, not batch_size x block_size
    for r in recs:
        assert r["tokens_per_s"] * r["dt"] == pytest.approx(r["rl/trained_tokens"], rel=1e-9, abs=1e-9)
    # the console line: the reward, and the latest held-out pass rates with the step they were measured at
    assert recs[0]["rl/heldout"] == {
        "step": 0,
        "pass@1": held_recs[0]["rl/pass@1"],
        "pass@2": held_recs[0]["rl/pass@2"],
    }
    lines = [line for line in out.splitlines() if line.lstrip().startswith("step ") and "| lr " in line]
    assert len(lines) == 3 and all(
        f"reward {r['rl/reward_mean']:.3f}" in lines[i] for i, r in enumerate(recs)
    )
    assert "held-out pass@1" in lines[0] and "(step 0)" in lines[0] and "(step 2)" in lines[2]


def test_rl_with_lora_kl_and_several_updates_per_batch(rl_root):
    extra = ["--finetune.lora_rank=4", "--rl.kl_coef=0.1", "--rl.updates_per_batch=2", "--train.steps=4"]
    assert main(rl_args(rl_root, "lora", *REGEX, *extra)) == 0
    recs = _records(rl_root / "runs" / "lora")
    assert "rl/kl" in recs[0] and recs[0]["rl/kl"] == 0  # the first step's policy is the reference
    # a rollout every second step: its figures on steps 1 and 3; steps 2 and 4 reuse the batch (the ratio)
    assert ["rl/reward_mean" in r for r in recs] == [True, False, True, False]
    assert recs[1]["rl/kl"] >= 0


def test_engine_logprobs_match_the_training_forward(rl_root):
    """The log-probability the engine reports for each sampled token against a training forward (fp32, CPU)
    of the whole sampled sequences, as the RL loss computes it: bit for bit under batch-invariant forwards
    (loom.model.batch_invariant; without them the CPU's kernels, which choose their paths by the number of
    rows and the sequence length, leave ~1e-7 to 1e-5, recorded each step as rl/logprob_diff)."""
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import read_meta
    from loom.model.batch_invariant import batch_invariant
    from loom.model.registry import spec_of
    from loom.rl.prompts import load_prompts, rl_template
    from loom.rl.rollout import build_batch, sample
    from loom.runs import pretrained_state

    cfg = config_from_dict(load_toml(rl_root / "runs" / "full" / "config.toml"))
    meta = read_meta(rl_root / "chat")
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu")
    model.load_state_dict(pretrained_state(cfg, model), strict=False)
    template = rl_template(rl_root / "chat", meta)
    prompts = load_prompts(rl_root / "arith" / "rl_train.jsonl", "answer", template, 32, 4)
    seeds = [[10 * i + g for g in range(4)] for i in range(6)]
    reqs = sample(model, prompts.ids[:6], seeds, 4, template.stop_ids, meta["vocab_size"], batch_invariant)
    b = build_batch(reqs, [1.0] * len(reqs), [True] * len(reqs), template.eot_id)
    with torch.no_grad(), batch_invariant():  # as loom rl runs both (rl.batch_invariant, on by default)
        logp = F.log_softmax(model(b.x).float(), -1)
    mask = b.y != -1
    lp = logp.gather(-1, b.y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert int(mask.sum()) == sum(len(r.tokens) + (r.stop_token is not None) for r in reqs) > 0
    assert torch.equal(lp[mask], b.old_lp[mask])  # bit for bit


def test_resume_gives_the_rewards_and_losses_of_an_uninterrupted_run(rl_root):
    """A run of 2 steps continued to 4 (a constant learning rate: the schedule does not depend on train.steps)
    against one of 4; the kill -9 form is tests/faults/test_rl_kill_resume.py."""
    flat = [*REGEX, "--optim.min_lr=1e-3", "--train.ckpt_every=2"]
    assert main(rl_args(rl_root, "whole", *flat, "--train.steps=4")) == 0
    assert main(rl_args(rl_root, "cut", *flat, "--train.steps=2")) == 0
    assert main([*rl_args(rl_root, "cut", *flat, "--train.steps=4"), "--resume"]) == 0
    whole, cut = _records(rl_root / "runs" / "whole"), _records(rl_root / "runs" / "cut")
    keys = ("loss", "grad_norm", "rl/reward_mean", "rl/response_len", "rl/entropy")
    assert any(r["grad_norm"] > 0 for r in whole[2:])
    assert [[r[k] for k in keys] for r in whole[2:]] == [[r[k] for k in keys] for r in cut[-2:]]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.group_size=1"], "a group of one"),
        (["--train.batch_size=6"], "whole groups"),
        (["--rl.answer_field=solution"], "lack the field 'solution'"),
        (["--rl.max_new_tokens=31"], "every prompt is longer"),
        (["--rl.reward=no_such_reward_module:score"], "does not import"),
    ],
)
def test_bad_rl_input_is_a_clear_error(rl_root, extra, message, capsys):
    assert main(rl_args(rl_root, "bad", *extra, "--train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "loom: error:" in err and message in err and "Traceback" not in err, err
    assert not (rl_root / "runs" / "bad" / "metrics.jsonl").exists()  # refused before any step


def test_rl_refuses_missing_prompts_and_takes_a_base_runs_text_as_raw_prompts(rl_root, capsys):
    """A base run's plain-text data is RL's too (R1-Zero style, tests/unit/test_rl_base.py); no prompts is an
    error before any work."""
    args = rl_args(rl_root, "bad2", "--train.steps=1")
    assert main([a for a in args if not a.startswith("--rl.prompts=")]) == 2
    assert "rl.prompts is not set" in capsys.readouterr().err
    from loom.data.loader import read_meta
    from loom.rl.prompts import TextTemplate, rl_template

    assert isinstance(rl_template(rl_root / "text", read_meta(rl_root / "text")), TextTemplate)


def test_a_failing_reward_is_a_counted_skip_and_an_error_when_every_sample_fails(
    rl_root, tmp_path, monkeypatch, capsys
):
    (tmp_path / "flaky_rewards.py").write_text(
        "def half(s):\n    if s.text.startswith('1'):\n        raise ValueError('no')\n    return float('2' in s.text)\n"
        "def never(s):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(rl_args(rl_root, "flaky", "--rl.reward=flaky_rewards:half", "--train.steps=2")) == 0
    recs = _records(rl_root / "runs" / "flaky")
    assert (
        sum(r["rl/reward_errors"] for r in recs) > 0
    )  # answers starting with 1: counted, their groups dropped
    assert all(r["rl/error_groups"] <= 2 for r in recs)
    assert main(rl_args(rl_root, "never", "--rl.reward=flaky_rewards:never", "--train.steps=1")) == 2
    assert "failed on every sample" in capsys.readouterr().err


HANGING = """
import time

STATE = {"calls": 0, "every": 0}


def score(sample):
    \"\"\"regex's reward for a 1 in the answer; every STATE["every"]-th call hangs (and catches what it can).\"\"\"
    STATE["calls"] += 1
    if STATE["every"] and STATE["calls"] % STATE["every"] == 0:
        try:
            time.sleep(3600)
        except Exception:  # a reward's own handler must not swallow the timeout
            pass
        while True:
            pass
    return float("1" in sample.text)
"""


def test_a_reward_that_hangs_is_cut_by_rl_reward_timeout_and_counted(rl_root, tmp_path, monkeypatch):
    """Every fourth reward call hangs (asleep, then in a busy loop): rl.reward_timeout=0.2 cuts each, its sample
    dropped and counted as a failed reward, and the run goes on."""
    (tmp_path / "hanging_reward.py").write_text(HANGING)
    monkeypatch.syspath_prepend(str(tmp_path))
    import hanging_reward

    hanging_reward.STATE.update(calls=0, every=4)
    args = rl_args(rl_root, "hang", "--rl.reward=hanging_reward:score", "--rl.reward_timeout=0.2")
    assert main([*args, "--train.steps=2"]) == 0
    recs = _records(rl_root / "runs" / "hang")
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["rl/reward_errors"] for r in recs] == [2, 2]  # 8 answers a step: calls 4 and 8 cut
    assert [r["rl/error_groups"] for r in recs] == [2, 2]  # one cut answer in each group of 4


def test_rl_that_drops_every_group_says_so_and_stops(rl_root, capsys):
    """A reward no answer earns (all 0): every group's rewards are equal, no advantage. Each step's console line
    says why instead of a loss of 0, and rl.max_dropped_steps=3 such steps in a row stop the run with an error
    that says what the rewards were, before a fourth step."""
    args = rl_args(rl_root, "flat", "--rl.reward=regex", "--rl.pattern=^never$", "--rl.max_dropped_steps=3")
    assert main([*args, "--train.steps=10"]) == 2
    out, err = capsys.readouterr()
    assert "loom: error: the last 3 steps dropped every group" in err and "Traceback" not in err, err
    assert "rewards between 0 and 0 over 2 groups" in err and "too hard" in err
    recs = _records(rl_root / "runs" / "flat")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["rl/trained_tokens"] == 0 and r["loss"] == 0 for r in recs)
    lines = [line for line in out.splitlines() if "no gradient" in line]
    assert len(lines) == 2 and all("all 2 groups dropped (2 with equal rewards)" in line for line in lines)
    assert not any("loss 0.0000" in line for line in lines)


@pytest.fixture(scope="module")
def saved_rl_run(rl_root):
    """An RL run of 2 steps with a checkpoint at its end, resumed by the tests below (never continued)."""
    assert main(rl_args(rl_root, "saved", *REGEX, "--train.steps=2", "--train.ckpt_every=2")) == 0
    return rl_root / "runs" / "saved"


@pytest.mark.parametrize(
    "change, message",
    [
        (["--rl.group_size=2"], "rl.group_size: the run's 4, this resume's 2"),
        (["--train.batch_size=16"], "train.batch_size: the run's 8, this resume's 16"),
        (["--run.seed=7"], "run.seed: the run's 1337, this resume's 7"),
        (["--rl.prompts={other}"], "holds other prompts"),
    ],
)
def test_a_resume_with_other_rl_settings_is_refused(saved_rl_run, rl_root, tmp_path, change, message, capsys):
    """As data.mix refuses another mixture on resume: the rollouts after the checkpoint would not be the run's.
    The same prompts moved elsewhere (the same content) are the same prompts: that resume goes on."""
    prompts = (rl_root / "arith" / "rl_train.jsonl").read_text().splitlines()
    (tmp_path / "other.jsonl").write_text("\n".join(prompts[1:] + prompts[:1]) + "\n")  # reordered
    (tmp_path / "moved.jsonl").write_text("\n".join(prompts) + "\n")
    change = [c.format(other=tmp_path / "other.jsonl") for c in change]
    resume = ["rl", "--resume", str(saved_rl_run), "--train.steps=3"]
    assert main([*resume, *change]) == 2
    err = capsys.readouterr().err
    assert "loom: error: the checkpoint's rollouts were drawn with other RL settings" in err, err
    assert message in err and "resume with the run's own" in err
    if change[0].startswith("--rl.prompts"):
        copy = rl_root / "runs" / "saved-moved"
        shutil.copytree(saved_rl_run, copy)
        assert (
            main(["rl", "--resume", str(copy), "--train.steps=3", f"--rl.prompts={tmp_path / 'moved.jsonl'}"])
            == 0
        )


def test_rl_sft_and_dpo_resume_a_run_from_its_folder_alone(rl_root, saved_rl_run):
    """`loom rl|sft|dpo --resume RUN` read what the verb insists on (prompts, data, model.init_from) from the
    run's saved config, as `loom train --resume RUN` does: no flag again."""
    runs = rl_root / "runs"
    copy = runs / "rl-again"
    shutil.copytree(saved_rl_run, copy)
    assert main(["rl", "--resume", str(copy), "--train.steps=3"]) == 0
    assert [r["step"] for r in _records(copy)][-1] == 3
    sft = [f"--data.path={rl_root / 'chat'}", f"--model.init_from=run:{runs / 'sft'}", f"--run.dir={runs}"]
    assert main(["sft", *sft, "--run.name=sft-r", *QUIET, "--train.steps=2", "--train.batch_size=8"]) == 0
    assert main(["sft", "--resume", str(runs / "sft-r"), "--train.steps=3"]) == 0
    pairs = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a in range(9)
        for b in range(9)
    ]
    (rl_root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prep = [
        "data",
        "prepare",
        "--pairs",
        "--input",
        str(rl_root / "pairs.jsonl"),
        "--out",
        str(rl_root / "pref"),
    ]
    assert main([*prep, "--tokenizer", str(runs / "sft"), "--block-size", "32"]) == 0
    dpo = [f"--data.path={rl_root / 'pref'}", f"--model.init_from=run:{runs / 'sft'}", f"--run.dir={runs}"]
    assert main(["dpo", *dpo, "--run.name=dpo-r", *QUIET, "--train.steps=2", "--train.batch_size=4"]) == 0
    assert main(["dpo", "--resume", str(runs / "dpo-r"), "--train.steps=3"]) == 0
    for name in ("sft-r", "dpo-r"):
        assert [r["step"] for r in _records(runs / name)][-1] == 3


def _prompts(rl_root, tmp_path, lines: list[str], max_new: int = 4):
    from loom.data.loader import read_meta
    from loom.rl.prompts import load_prompts, rl_template

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    template = rl_template(rl_root / "chat", read_meta(rl_root / "chat"))
    return load_prompts(path, "answer", template, 32, max_new)


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "1+2=", "answer": "3"}', "", "{not json"], r"p.jsonl:3: not JSON"),
        (['{"prompt": "1+2=", "answer": "3"}', "[1, 2]"], r"p.jsonl:2: a prompt row is a JSON object"),
        (['{"prompt": "1+2=", "answer": "3"}', "", '{"answer": "3"}'], r"p.jsonl:3: a prompt row needs"),
        (['{"messages": [{"role": "user"}], "answer": "3"}'], r"p.jsonl:1: 'messages' is a non-empty list"),
        (
            ['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "2+2=4", "answer": "4"}'],
            r"p.jsonl:2: the prompt already ends with its answer '4'",
        ),
        (
            ['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "x", "answer": "3"}', '{"prompt": "y"}'],
            r"1 of 3 prompt rows lack the field 'answer' the reward reads \(first: line 3\)",
        ),
    ],
)
def test_prompt_file_errors_name_the_file_and_the_line(rl_root, tmp_path, lines, message):
    with pytest.raises(LoomError, match=message):
        _prompts(rl_root, tmp_path, lines)


def test_prompts_that_leave_no_room_for_the_answer_are_refused_with_the_numbers(rl_root, tmp_path):
    from loom.config import config_from_dict, validate

    ok = _prompts(
        rl_root, tmp_path, ['{"prompt": "0+5", "answer": "5"}', '{"prompt": "1+2=", "answer": "3"}']
    )
    assert len(ok) == 2  # "0+5" ends with its answer but not after "=": a question, not an answer
    with pytest.raises(
        LoomError,
        match=r"the \d+ tokens its answer leaves \(model.block_size=32 minus rl.max_new_tokens=30\); the shortest is \d+ tokens \(line 1\)",
    ) as e:
        _prompts(rl_root, tmp_path, ['{"prompt": "1+2=", "answer": "3"}'], max_new=30)
    assert "lower rl.max_new_tokens to" in e.value.hint
    cfg = {
        "model": {"block_size": 32},
        "train": {"batch_size": 8},
        "rl": {"prompts": "p.jsonl", "group_size": 4},
    }
    cfg["rl"]["max_new_tokens"] = 40
    with pytest.raises(
        LoomError, match=r"rl.max_new_tokens=40 leaves no room for a prompt in model.block_size=32"
    ):
        validate(config_from_dict(cfg), world=1)


@pytest.mark.parametrize("keys", [{"pp": 2}, {"cp": 2}, {"dp_impl": "mpi"}, {"tp": 2, "sp": True}])
def test_rl_layouts_that_split_an_answer_are_refused(keys):
    from loom.config import config_from_dict, validate

    cfg = config_from_dict(
        {
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
            "train": {"batch_size": 8},
            "rl": {"prompts": "p.jsonl", "group_size": 4},
            "parallel": keys,
        }
    )
    why = "decodes one token" if "sp" in keys else "a whole answer per rank"
    with pytest.raises(LoomError, match=why):
        validate(cfg, world=2)


def test_plot_draws_the_rl_panels(rl_root, tmp_path, monkeypatch):
    """The policy loss and the chat data's val loss on axes of their own; the reward's spread (mean +- std)
    clipped to the range the rewards took (0 to 1 here, never below 0)."""
    import matplotlib.figure
    from matplotlib.collections import PolyCollection

    from loom.plot import plot_runs

    run = rl_root / "runs" / "full"
    if not (run / "metrics.jsonl").exists():
        assert main(rl_args(rl_root, "full", *REGEX, "--train.steps=2")) == 0
    figs = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda f, *a, **k: (figs.append(f), save(f, *a, **k))
    )
    out = plot_runs([run], tmp_path / "rl.png")
    assert out.stat().st_size > 10_000
    axes = {a.get_ylabel(): a for a in figs[0].axes}
    policy = axes["loss (RL: policy loss)"]
    val = next(a for label, a in axes.items() if label.startswith("RL runs: val loss"))
    assert [line.get_label() for line in policy.lines] == ["full policy loss"]
    assert [line.get_label() for line in val.lines] == ["full val loss (chat data)"]
    reward = axes["reward / held-out pass rate"]
    band = next(c for c in reward.collections if isinstance(c, PolyCollection))
    ys = band.get_paths()[0].vertices[:, 1]
    recs = _records(run)
    low = min(r["rl/reward_min"] for r in recs if "rl/reward_min" in r)
    high = max(r["rl/reward_max"] for r in recs if "rl/reward_max" in r)
    assert low >= 0 and high <= 1 and ys.min() >= low and ys.max() <= high


def test_the_batch_holds_trained_rows_and_fills_each_micro_batch():
    """A dropped group's rows have no targets: the batch leaves them out, except as many as make the row count
    a multiple of the gradient accumulation steps (every micro-batch gets its share)."""
    from loom.engine import Request, SamplingParams
    from loom.rl.rollout import build_batch

    reqs = []
    for j in range(8):
        r = Request([1, 2, 3], SamplingParams(max_tokens=4, logprobs=True))
        r.tokens, r.logprobs = [4 + j, 5], [-0.5, -0.25]
        reqs.append(r)
    trained = [True] * 3 + [False] * 5
    b = build_batch(reqs, [1.0] * 8, trained, 0)
    assert b.x.shape == (3, 4) and b.x[:, 3].tolist() == [4, 5, 6]
    b = build_batch(reqs, [1.0] * 8, trained, 0, accum=2)
    assert b.x.shape[0] == 4 and (b.y[3] == -1).all() and (b.y[:3] != -1).sum() == 6
    b = build_batch(reqs, [0.0] * 8, [False] * 8, 0, accum=4)  # every group dropped: one row per micro-batch
    assert b.x.shape[0] == 4 and (b.y == -1).all()
    b = build_batch(reqs, [float(j) for j in range(8)], [True] * 8, 0)  # targets after the prompt, at its end
    assert b.y[:, 2:].tolist() == [[4 + j, 5] for j in range(8)] and (b.y[:, :2] == -1).all()
    assert b.adv.tolist() == [[0.0, 0.0, float(j), float(j)] for j in range(8)]
    assert b.old_lp.tolist() == [[0.0, 0.0, -0.5, -0.25]] * 8


def test_a_bad_rl_step_is_skipped_and_names_its_prompts(rl_root, monkeypatch):
    """A NaN gradient at step 2 (LOOM_FAULT_NAN_STEPS): the step is skipped and its record says which rollout and
    which rl.prompts rows it trained on (RL's batches are rollouts, not rows of a token file); the run goes on."""
    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", "2")
    assert main(rl_args(rl_root, "nan", *REGEX, "--train.steps=3")) == 0
    bad = [r for r in _records(rl_root / "runs" / "nan") if r.get("skipped")]
    assert [r["step"] for r in bad] == [2]
    assert bad[0]["rollout"] == 2 and len(bad[0]["prompts"]) == 2
    assert all(0 <= i < 200 for i in bad[0]["prompts"])
