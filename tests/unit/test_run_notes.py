"""What a run would otherwise leave silent, said (issue 58): a warm-up longer than the run, data read more than
once, a BPE vocabulary smaller than asked. Compared against the schedule's own arithmetic
(loom.optim.schedule.lr_at) and the trained tokenizer's size."""

from __future__ import annotations

from loom.config import Config
from loom.optim.schedule import lr_at
from loom.train.budget import run_length_warnings


def _cfg(steps: int, warmup: int) -> Config:
    cfg = Config()
    cfg.train.steps, cfg.optim.warmup_steps, cfg.model.block_size = steps, warmup, 64
    return cfg


def test_a_warm_up_longer_than_the_run_is_said_with_the_last_steps_lr():
    cfg = _cfg(30, 100)
    (line,) = run_length_warnings(cfg, None, 8)
    assert line.startswith("30 steps < 100 warm-up steps: the peak lr 0.001 is never reached"), line
    last = lr_at(29, cfg.optim.lr, 0.0, 100, 30)  # the last step's lr, as the trainer sets it
    assert f"the last step's is {last:.3g}" in line
    assert run_length_warnings(_cfg(100, 100), None, 8) == []  # step 99 is at the peak


def test_epochs_are_said_when_the_run_reads_its_data_more_than_once():
    cfg = _cfg(260, 10)
    (line,) = run_length_warnings(cfg, rows_per_epoch=800, rows_per_step=8)
    assert "the run reads its training tokens 2.6 times (epochs)" in line, line
    assert run_length_warnings(cfg, rows_per_epoch=8 * 260, rows_per_step=8) == []  # exactly one pass
    assert run_length_warnings(cfg, rows_per_epoch=None, rows_per_step=8) == []  # a loader that cannot say


def test_a_bpe_vocabulary_smaller_than_asked_is_said(capsys):
    from loom.data.tokenizers import HFTokenizer

    tok = HFTokenizer.train(["the cat sat on the mat. " * 40], 1000, trainer="tokenizers")
    out = capsys.readouterr().out
    merges = tok.vocab_size - 257  # the 256 bytes and the end-of-text token come before the merges
    assert 0 < merges and tok.vocab_size < 1000
    assert f"BPE vocabulary: 1,000 asked, the corpus gave only {merges} merges" in out, out
    assert f"so the vocabulary is {tok.vocab_size}" in out
