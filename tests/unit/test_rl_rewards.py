"""RL's rewards, advantages and loss (loom.rl), unit by unit.

Compared against: the rewards' definitions on hand-made answers; a user module written here (it raises,
returns NaN, returns a string); advantages computed by hand; the policy-gradient loss's gradient against the
advantage-weighted cross-entropy it must equal on-policy, and the clipped surrogate's zero gradient outside
its bounds; the k3 estimator's closed form; rewards that hang against rl.reward_timeout and a real SIGTERM."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from loom.errors import LoomError
from loom.rl.loss import k3, policy_loss
from loom.rl.rewards import Reward, RewardGuard, RewardStopped, final_answer, load_reward
from loom.rl.rollout import advantages, prompt_index, sample_seed


def test_builtin_rewards():
    exact = load_reward("exact", "answer")
    assert exact.score({"answer": "46"}, " 46 ") == (1.0, None)
    assert exact.score({"answer": "46"}, "work\n#### 46") == (1.0, None)
    assert exact.score({"answer": "46"}, "47") == (0.0, None)
    assert final_answer("a\n\nb\n") == "b"
    num = load_reward("numeric", "answer")
    assert num.score({"answer": "12"}, "so it is 12.0") == (1.0, None)
    assert num.score({"answer": 3}, "2 then 4") == (0.0, None)
    assert num.score({"answer": 3}, "no digits") == (0.0, None)
    v, why = num.score({"answer": "x"}, "3")  # a field that is not a number: the sample's counted skip
    assert v is None and "not a number" in why
    rx = load_reward("regex", "answer", r"^\d+$")
    assert rx.field is None
    assert rx.score({}, "123") == (1.0, None) and rx.score({}, "12a") == (0.0, None)
    with pytest.raises(LoomError, match="needs rl.pattern"):
        load_reward("regex", "answer", "")
    with pytest.raises(LoomError, match="not a regular expression"):
        load_reward("regex", "answer", "(")
    with pytest.raises(LoomError, match="neither a built-in"):
        load_reward("exactly", "answer")


def test_user_reward_functions_and_their_failures(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def good(s):\n    return float(len(s.text))\n"
        "def boom(s):\n    raise KeyError('x')\n"
        "def nan(s):\n    return float('nan')\n"
        "def word(s):\n    return 'yes'\n"
        "def flag(s):\n    return True\n"
    )
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:good", "answer").score({"q": 1}, "abc") == (3.0, None)
    for name, why in [
        ("boom", "raised KeyError"),
        ("nan", "returned nan"),
        ("word", "str"),
        ("flag", "bool"),
    ]:
        v, reason = load_reward(f"my_rewards:{name}", "answer").score({}, "a")
        assert v is None and why in reason, (name, reason)
    with pytest.raises(LoomError, match="does not import"):
        load_reward("broken_rewards:f", "answer")
    with pytest.raises(LoomError, match="does not import"):
        load_reward("no_such_module_here:f", "answer")
    with pytest.raises(LoomError, match="has no function 'missing'"):
        load_reward("my_rewards:missing", "answer")
    sys.modules.pop("my_rewards", None)


def test_group_relative_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv, kept = advantages(r, "mean")
    assert torch.equal(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert kept.tolist() == [True, False, True]  # all equal: no signal (dynamic sampling drops it)
    adv, _ = advantages(r, "std")
    std = math.sqrt(sum((v - 0.75) ** 2 for v in [0, 0, 0, 3]) / 4)
    assert torch.allclose(adv[2], torch.tensor([-0.75, -0.75, -0.75, 2.25]) / (std + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4))


def test_seeds_and_prompt_order_depend_on_position_only():
    assert sample_seed(1, 2, 3, 4) == sample_seed(1, 2, 3, 4) != sample_seed(1, 2, 3, 5)
    order = [prompt_index(p, 10, 7) for p in range(20)]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(
        range(10)
    )  # each once an epoch
    assert order[:10] != order[10:]


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    y = torch.tensor([[-1, 3, 2, 6, -1], [-1, -1, 1, 0, 4]])
    adv = torch.tensor([[0.0, 1.5, 1.5, 1.5, 0.0], [0.0, 0.0, -0.7, -0.7, -0.7]])
    return logits, y, adv


def test_on_policy_loss_is_the_advantage_weighted_cross_entropy():
    logits, y, adv = _case()
    lp = F.log_softmax(logits.detach(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss, stats = policy_loss(logits, y, adv, lp, (0.2, 0.28))
    (g1,) = torch.autograd.grad(loss, logits)
    ce = F.cross_entropy(logits.view(-1, 7), y.view(-1), ignore_index=-1, reduction="none").view(2, 5)
    (g2,) = torch.autograd.grad((ce * adv).sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-6)
    assert stats["targets"] == 6 and stats["clipped"] == 0 and stats["logprob_diff"] == 0


def test_clipped_ratio_stops_the_gradient_outside_its_bounds():
    logits, y, adv = _case(1)
    lp = F.log_softmax(logits.detach(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    old = lp - 1.0  # ratio e > 1 + 0.28 everywhere: positive advantages clipped, negative ones not
    loss, stats = policy_loss(logits, y, adv, old, (0.2, 0.28))
    (g,) = torch.autograd.grad(loss, logits)
    assert stats["clipped"] == 3  # the first row's three targets (advantage 1.5 > 0)
    assert torch.equal(g[0], torch.zeros_like(g[0])) and g[1].abs().sum() > 0
    assert abs(float(stats["logprob_diff"]) - 1.0) < 1e-6


def test_k3_kl_estimator():
    ref, lp = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.5, -0.7])
    d = ref - lp
    assert torch.allclose(k3(ref, lp), torch.exp(d) - d - 1)
    assert k3(ref, ref).abs().max() == 0 and (k3(ref, lp) >= 0).all()
    logits, y, adv = _case()
    lp_t = F.log_softmax(logits.detach(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    base, _ = policy_loss(logits, y, adv, lp_t, (0.2, 0.28))
    with_kl, stats = policy_loss(logits, y, adv, lp_t, (0.2, 0.28), lp_t - 0.1, 0.5)
    assert float(stats["kl"]) > 0
    assert torch.allclose(with_kl - base, 0.5 * stats["kl"], atol=1e-5)


def _sleeps(sample):
    time.sleep(3600)


def _spins_and_swallows(sample):
    while True:
        try:
            time.sleep(0.01)
        except Exception:  # a reward's own broad handler: the timeout is no Exception, so it gets through
            pass


def test_a_reward_past_rl_reward_timeout_is_a_counted_skip():
    guard = RewardGuard(0.1)
    before = signal.getsignal(signal.SIGALRM)
    with guard.watching():
        for fn in (_sleeps, _spins_and_swallows):
            t0 = time.monotonic()
            v, why = Reward("mine", fn, None).score({}, "x", guard)
            assert v is None and "past rl.reward_timeout=0.1s" in why
            assert time.monotonic() - t0 < 30  # cut, not slept out
        v, why = Reward("ok", lambda s: 1.0, None).score({}, "x", guard)  # the bound ends with its call
        time.sleep(0.2)
        assert (v, why) == (1.0, None)
    assert signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_stop_signal_interrupts_a_hung_reward_and_reaches_the_previous_handler():
    """A real SIGTERM to this process while a reward sleeps: the handler the guard replaced (the trainer's stop
    flag) still runs, the reward is interrupted (RewardStopped) and the guard says which signal stopped it."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        guard = RewardGuard()  # no timeout: only the signal ends the call
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with guard.watching(), pytest.raises(RewardStopped):
            Reward("hangs", _sleeps, None).score({}, "x", guard)
        assert seen == [signal.SIGTERM] and guard.stopped == "SIGTERM"
    finally:
        restored = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
    assert callable(restored) and restored.__name__ == "<lambda>"  # the guard put the trainer's back
