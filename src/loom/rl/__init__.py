"""loom.rl: reinforcement learning on verifiable rewards (GRPO, with DAPO's token-level normalisation), the
`loom rl` stage.

The choices, and why:
  - One training loop. RL is a training stage (`stage.RL`, first in loom.train.stage.STAGES when rl.prompts is
    set): its batches are rollouts (G samples per prompt from loom.engine on the model as it is now), its
    micro-batch loss the clipped policy gradient (`loss.py`). The trainer steps and asks the stage, as it does
    pretraining and SFT, so checkpoints, the bad-step guard, metrics, evaluators and layouts come for free.
  - Each sample's seed is a function of (run.seed, rollout, the prompt's place in the stream, sample index),
    and the prompt order a function of (run.seed, epoch): the rollouts of a step are the same on every layout
    (each data-parallel rank samples for its own prompts) and after a resume, with nothing to save but the
    count of rollouts drawn.
  - Group-relative advantages ((r - mean) / std, or r - mean) inside a group, which one rank holds whole;
    groups whose rewards are all equal carry no signal and are dropped (dynamic sampling, counted).
  - Token-level normalisation (DAPO): the step's loss is the sum over every trained token of the global batch
    over their count, whatever the micro-batching or the number of ranks.
  - The importance ratio is against the sampler's own log-probabilities (the engine's), so it is exp(trainer -
    sampler): what `rl/logprob_diff` measures each step. Clipped (DAPO's clip-higher bounds) when a batch is
    used for rl.updates_per_batch > 1 optimizer steps; on the first step it is 1 up to that difference.
  - An optional KL to the frozen start model (the k3 estimator, exp(ref - lp) - (ref - lp) - 1).
  - Rewards (`rewards.py`): built-ins (exact, numeric, regex) and `module:function(sample) -> float`; a reward
    that raises or returns NaN or a non-number drops its group, counted (rl/reward_errors).
  - Asynchronous rollouts (`async_rollout.py`, rl.max_staleness = K > 0): a worker process samples rollout r with
    the weights of step r - K (a fixed schedule: a run is reproducible, and K = 0 is the synchronous loop
    itself), pushed over a gloo group of its own (`weight_sync.py`), while the trainer trains; rl.is_cap's
    truncated importance weights correct the lag.
"""
