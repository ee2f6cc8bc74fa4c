"""Batch-size and sequence-length warm-up (layer 0): `train.batch_schedule` and `train.seq_schedule` read into
one `StepShape`, the shape of every step's global batch, and every rule they must obey checked before any work.

Both are written VALUE@STEP,... (a comma list, or a TOML list of strings): the value holds from the step after
STEP steps were taken on (0-based, as the learning rate's warm-up counts: 16@200 is metrics step 201 on), the
first at step 0, the steps increasing, the last value the run's own (train.batch_size, model.block_size).

The unit of data is the window of model.block_size tokens that the loaders cut (loom.data.loader). Step s reads
`windows(s)` consecutive windows of the global order, the next ones after those of the steps before it, so each
window is read once and in order whatever the schedule (`windows_before(s)` is where step s starts). With a
sequence length T(s) < block_size each window is cut into block_size / T(s) rows of T(s) tokens: the batch is
kept in tokens, not rows (modded-nanogpt keeps its tokens per step fixed while its attention window grows;
Li et al. 2022's sequence-length warm-up instead truncates and reads fewer tokens). Kept in tokens, a short
step trains on the same targets a full-length step would, only with less context: the data order, the token
count, the learning rate per token and the memory of a micro-batch (micro_batch_size windows, cut into more,
shorter rows) are those of the run without the schedule. Batch-size warm-up changes the number of
gradient-accumulation micro-batches, never their size: memory is that of the smallest batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import LoomError

KEYS = ("train.batch_schedule", "train.seq_schedule")


@dataclass(frozen=True)
class Ramp:
    """A piecewise-constant value over steps: `points` are (first step, value), steps increasing from 0."""

    points: tuple[tuple[int, int], ...]

    def at(self, step: int) -> int:
        """The value of 0-based step `step` (taken after `step` steps)."""
        value = self.points[0][1]
        for start, v in self.points:
            if start > step:
                break
            value = v
        return value

    @property
    def values(self) -> list[int]:
        return [v for _, v in self.points]

    def __str__(self) -> str:
        return ",".join(f"{v}@{s}" for s, v in self.points)


def parse_ramp(text: str, key: str, unit: str) -> Ramp:
    """VALUE@STEP,... read into a Ramp; every malformed item, a first step other than 0 and steps that do not
    increase are a LoomError naming `key`."""
    example = "8@0,16@200,32@400" if "batch" in key else "64@0,128@100,256@300"
    hint = f"write {key}=VALUE@STEP,... ({unit} from that step on), e.g. {example}"
    points = []
    for item in (p.strip() for p in text.split(",")):
        value, at, step = item.partition("@")
        try:
            point = (int(step), int(value))
        except ValueError:
            raise LoomError(f"{key}: cannot read '{item}' as VALUE@STEP", hint=hint) from None
        if not at or point[1] <= 0 or point[0] < 0:
            raise LoomError(f"{key}: '{item}' needs a positive value and a step >= 0", hint=hint)
        points.append(point)
    if points[0][0] != 0:
        raise LoomError(
            f"{key}={text} starts at step {points[0][0]}: the first value must be at step 0 (what the first "
            "steps use)",
            hint=f"begin with VALUE@0, e.g. {example}",
        )
    for (s0, _), (s1, _) in zip(points, points[1:], strict=False):
        if s1 <= s0:
            raise LoomError(
                f"{key}={text}: the steps must increase ({s1} after {s0})",
                hint=f"list each value once, in step order, e.g. {example}",
            )
    return Ramp(tuple(points))


@dataclass(frozen=True)
class StepShape:
    """Each step's global batch: `windows(s)` windows of `block_size` tokens, cut into rows of `seq_len(s)`."""

    batch: Ramp
    seq: Ramp
    block_size: int

    def windows(self, step: int) -> int:
        """Windows (sequences of block_size tokens) of 0-based step `step`, all ranks together."""
        return self.batch.at(step)

    def seq_len(self, step: int) -> int:
        """The length of step `step`'s rows."""
        return self.seq.at(step)

    def tokens(self, step: int) -> int:
        """Step `step`'s trained targets, all ranks together (its windows' tokens: cutting keeps them all)."""
        return self.windows(step) * self.block_size

    def windows_before(self, step: int) -> int:
        """Windows the first `step` steps read: where step `step` starts in the global order."""
        total, points = 0, self.batch.points
        for i, (start, v) in enumerate(points):
            end = points[i + 1][0] if i + 1 < len(points) else step
            total += v * max(0, min(end, step) - start)
        return total

    def tokens_before(self, step: int) -> int:
        return self.windows_before(step) * self.block_size

    def describe(self) -> str:
        """The schedules as the run's first lines say them."""
        out = []
        if len(self.batch.points) > 1:
            out.append(f"batch {self.batch} (sequences@step)")
        if len(self.seq.points) > 1:
            out.append(f"length {self.seq} (tokens@step; the batch kept in tokens)")
        return "; ".join(out)


def step_shape(t, block_size: int) -> StepShape | None:
    """The StepShape of a config's train section `t` (None when neither schedule is set). Parsing only: the
    rules between keys are `check_schedules`'."""
    if not (t.batch_schedule or t.seq_schedule):
        return None
    batch = parse_ramp(t.batch_schedule, KEYS[0], "sequences") if t.batch_schedule else None
    seq = parse_ramp(t.seq_schedule, KEYS[1], "tokens per row") if t.seq_schedule else None
    return StepShape(batch or Ramp(((0, t.batch_size),)), seq or Ramp(((0, block_size),)), block_size)


def micro_windows(t, dp: int, shape: StepShape | None) -> int:
    """Windows per micro-batch per rank: train.micro_batch_size, or (0) the smallest batch over dp, so that
    every step is whole micro-batches on every rank."""
    if t.micro_batch_size:
        return t.micro_batch_size
    smallest = min(shape.batch.values) if shape is not None else t.batch_size
    return max(1, smallest // dp)


def check_schedules(cfg, dp: int) -> StepShape | None:
    """Every rule of the two schedules against the config and its data-parallel size, before any work; returns
    the StepShape (None: no schedule). What the data holds is the loader's check (loom.data.loader)."""
    t = cfg.train
    shape = step_shape(t, cfg.model.block_size)
    if shape is None:
        return None
    _check_layout(cfg, bool(t.seq_schedule))
    if t.batch_schedule:
        _check_batch(t, dp, shape)
    if t.seq_schedule:
        block = cfg.model.block_size
        for n in shape.seq.values:
            if n > block or block % n:
                why = "above" if n > block else "does not divide"
                raise LoomError(
                    f"train.seq_schedule length {n} {why} model.block_size={block}: each length cuts the "
                    "block_size windows into whole rows",
                    hint=f"use lengths that divide {block} (e.g. {block // 4},{block // 2},{block})",
                )
        if shape.seq.values[-1] != block:
            raise LoomError(
                f"train.seq_schedule={t.seq_schedule} ends at {shape.seq.values[-1]}, not at model.block_size={block}"
                " (the length the run trains at after the warm-up, and validates at)",
                hint=f"end the schedule with {block}@STEP",
            )
    return shape


def _check_batch(t, dp: int, shape: StepShape) -> None:
    """The batch schedule ends at train.batch_size, and each size is whole micro-batches on every rank."""
    if shape.batch.values[-1] != t.batch_size:
        raise LoomError(
            f"train.batch_schedule={t.batch_schedule} ends at {shape.batch.values[-1]} sequences, not at "
            f"train.batch_size={t.batch_size} (the batch after the warm-up)",
            hint=f"set --train.batch_size={shape.batch.values[-1]}, or end the schedule with {t.batch_size}@STEP",
        )
    micro = micro_windows(t, dp, shape)
    for size in shape.batch.values:
        if size % (dp * micro):
            raise LoomError(
                f"train.batch_schedule size {size} does not divide over {dp} data-parallel rank(s) x "
                f"train.micro_batch_size={micro} = {dp * micro} sequences per micro-step",
                hint="make every size a multiple of data-parallel ranks x micro_batch_size (set "
                "--train.micro_batch_size to a divisor of the smallest size over the ranks)",
            )


def _check_layout(cfg, seq: bool) -> None:
    """What the schedules do not serve, refused by name: pipeline parallel (its schedule's micro-batches are
    fixed), torchft (it skips a missing group's rows by a constant batch), RL (rollouts are its batches), data.mix
    (its phases are counted in rows of a constant batch); with a sequence schedule, context and tensor parallel
    (they split each row's tokens)."""
    p = cfg.parallel
    keys = " and ".join(
        k for k, v in zip(KEYS, (cfg.train.batch_schedule, cfg.train.seq_schedule), strict=True) if v
    )
    bad = [
        name
        for name, on in (
            (f"parallel.pp={p.pp}", p.pp > 1),
            ("ft.enabled", cfg.ft.enabled),
            ("rl.prompts (loom rl)", bool(cfg.rl.prompts)),
            ("data.mix", bool(cfg.data.mix)),
            (f"parallel.cp={p.cp}", seq and p.cp > 1),
            (f"parallel.tp={p.tp}", seq and p.tp > 1),
        )
        if on
    ]
    if bad:
        raise LoomError(
            f"{keys} cannot be used with {', '.join(bad)}",
            hint="drop the schedule, or train without those (the schedules serve pretraining on one data "
            "path under data parallel: ddp, zero, fsdp, hsdp" + ("" if seq else ", and tp/cp") + ")",
        )
