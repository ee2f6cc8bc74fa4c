"""The configuration's dataclass tree (layer 0): one dataclass per section, a docstring, default and bounds per
field (`_f`), and the tables of allowed values (CHOICES, PP_SCHEDULES). Parsing and writing: loom.config.io;
the checks: loom.config.validate; the layout a config resolves to: loom.config.layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


def family_key(default: Any, doc: str, **bounds: Any):
    """A field of a family's own config section (ModelSpec.keys), as `_f`; `choices` (a tuple) lists the values
    it takes (validate checks them)."""
    return field(default=default, metadata={"doc": doc, **bounds})


def _field_names(obj: Any) -> set[str]:
    return set(obj.__dataclass_fields__)


@dataclass(frozen=True)
class FamilySection:
    """What the config layer knows of a model family (loom.model.registry.register fills FAMILY_SECTIONS: the
    config never imports the model package): its preset of model keys, its own keys' dataclass (None: none),
    its rules (run by validate) and whether it has expert layers (parallel.ep)."""

    preset: dict[str, Any]
    keys: type | None = None
    check: Callable[[Any], None] | None = None
    experts: bool = False
    mup: bool = False  # the family declares its parameters' widths: model.mup applies (loom.model.mup)
    mtp: bool = False  # the family has multi-token prediction modules: model.mtp_depth applies


# model.family -> its section, one per registered family (built-in ones when loom.model is imported)
FAMILY_SECTIONS: dict[str, FamilySection] = {}


def _f(default: Any, doc: str, **bounds: Any):
    """A dataclass field with its documentation (shown by `loom train --help-config`) and the bounds validate()
    checks it against: gt / ge (lower), lt / le (upper); `why` (a note after the bound in the message), `also`
    (one more value allowed outside them), `msg` (the message of a rule that several fields share, formatted
    with the config's sections: '{optim.lr}'), `hint` (the remedy)."""
    return field(default=default, metadata={"doc": doc, **bounds})


# The messages of the bounds that several fields share (one rule, one message).
_POSITIVE_SHAPE = "model.rope_theta and model.norm_eps must be > 0; got {model.rope_theta}, {model.norm_eps}"
_DEFAULT_WIDTHS = (
    "model.n_kv_head and model.ffn_hidden must be >= 0 (0: the default); got {model.n_kv_head} and "
    "{model.ffn_hidden}"
)
_LR = "need 0 <= optim.min_lr <= optim.lr and lr > 0; got lr={optim.lr}, min_lr={optim.min_lr}"
_LR_HINT = "set --optim.min_lr (at most optim.lr), or leave it at -1: lr / 10"
MIN_LR_FOLLOWS = -1.0  # optim.min_lr's default: the end of the decay follows lr (lr / 10)
_BETAS = "optim.beta1/beta2 must be in [0, 1); got {optim.beta1}, {optim.beta2}"
_MUON = (
    "optim.muon_*: need muon_lr > 0, 0 <= muon_momentum < 1, muon_ns_steps >= 1, muon_weight_decay >= 0; "
    "got {optim.muon_lr}, {optim.muon_momentum}, {optim.muon_ns_steps}, {optim.muon_weight_decay}"
)
_DEGREES = "parallel.tp and parallel.pp must be >= 1; got tp={parallel.tp}, pp={parallel.pp}"
_HSDP = (
    "parallel.dp_replicate must be >= 1 and parallel.dp_shard >= 1 (or -1: the rest); got "
    "{parallel.dp_replicate} and {parallel.dp_shard}"
)


@dataclass
class RunConfig:
    dir: str = _f("runs", "Parent folder of run directories; a run lives in <run.dir>/<run.name>.")
    name: str = _f("", "Run name; empty picks a timestamp (YYYYmmdd-HHMMSS).")
    seed: int = _f(1337, "Seed for model initialisation, data order, dropout and sampling.")
    rank_logs: bool = _f(False, "Every rank also writes its own log file, <run>/logs/rank<N>.log.")


@dataclass
class DataConfig:
    path: str = _f("", "A prepared data directory (from `loom data prepare`). Empty: use data.corpus.")
    corpus: str = _f("python-stdlib", "Built-in corpus prepared (and cached) when data.path is empty.")
    tokenizer: str = _f("bpe", "Tokenizer for the built-in corpus: char | bpe.")
    vocab_size: int = _f(4096, "BPE vocabulary size for the built-in corpus.")
    cache_dir: str = _f("", "Where built-in corpora are prepared; empty: $LOOM_CACHE_DIR or ~/.cache/loom.")
    align: str = _f(
        "none",
        "none: training windows cut the token stream anywhere | bos: each window starts at a document start "
        "(the tokens after a window's end up to the next document are dropped; the count is printed).",
    )
    doc_mask: bool = _f(
        False,
        "Attention within each document only: a packed window's documents, opened by the data's end-of-text id "
        "(its meta.json tokenizer.eot_id), do not see each other (FlexAttention's block mask on a GPU).",
    )
    doc_positions: str = _f(
        "continue",
        "doc_mask: continue (positions run on across a window's documents) | restart (learned or RoPE positions "
        "count from 0 in each document, as if it ran alone).",
    )
    sources: str = _f(
        "", "Names for data.mix: NAME=PATH,NAME=PATH (each a prepared folder in any format loom reads)."
    )
    mix: str = _f(
        "",
        "A weighted mixture instead of data.path: SOURCE:WEIGHT,... where SOURCE is a name of data.sources, "
        "NAME=PATH, or a folder (named after its last part); weights are normalised. Which source each row "
        "comes from depends on (run.seed, row) only.",
    )
    mix_schedule: str = _f(
        "",
        "data.mix: new weights from given steps on, STEP@SOURCE:WEIGHT,...;STEP@... (a source not named "
        "weighs 0), e.g. the last 10 % of the steps on the best sources.",
    )
    mix_repeat: str = _f(
        "warn",
        "data.mix: a source read through that starts again: error (stop, at start if train.steps will need "
        "it) | warn | allow.",
    )


@dataclass
class ModelConfig:
    n_layer: int = _f(4, "Transformer blocks.", gt=0)
    n_head: int = _f(4, "Attention heads per block; must divide n_embd.", gt=0)
    n_embd: int = _f(192, "Residual stream width.", gt=0)
    block_size: int = _f(128, "Context length in tokens.", gt=0)
    dropout: float = _f(
        0.0, "Dropout probability (0 for pretraining-sized data, ~0.2 for tiny data).", ge=0, lt=1
    )
    bias: bool = _f(False, "Bias in Linear layers and LayerNorms (gpt2 has them; without is a bit faster).")
    vocab_size: int = _f(0, "Vocabulary size; 0 takes it from the data. Padded up to a multiple of 64.", ge=0)
    activation: str = _f(
        "gelu_tanh",
        "MLP activation: gelu_tanh (gpt2's tanh approximation; needed for gpt2 weights and HF export) | "
        "gelu (exact, erf; nanogpt's nn.GELU, ~2.5x faster on CPUs).",
    )
    init_from: str = _f(
        "",
        "hf:DIR starts from the weights of a GPT2LMHeadModel or LlamaForCausalLM saved by transformers in a local "
        "DIR (sets the model shape, including model.family and the options below; a tokenizer.json there is "
        "checked against the data's vocabulary); run:DIR from the newest checkpoint of a loom run (its model "
        "keys; data with the run's tokenizer plus chat tokens grows the embedding by their rows).",
    )
    family: str = _f(
        "gpt2",
        "Preset of the options below: gpt2 (learned positions, LayerNorm, GELU, tied head) | llama (pos=rope, "
        "norm=rmsnorm, mlp=swiglu, tie_embeddings=false, bias=false) | moe (llama's, with routed experts in "
        "the MLPs: its own keys, listed under it below) | a plug-in family. A key set explicitly overrides "
        "the preset.",
    )
    pos: str = _f("learned", "Positions: learned (a table of block_size vectors, gpt2) | rope (rotary).")
    rope_theta: float = _f(
        10000.0,
        "pos=rope: base period of the rotary frequencies (Llama 3: 500000).",
        gt=0,
        msg=_POSITIVE_SHAPE,
    )
    norm: str = _f("layernorm", "Normalisation: layernorm (gpt2) | rmsnorm (Llama: no mean, no bias).")
    norm_eps: float = _f(
        1e-5, "Epsilon of every LayerNorm/RMSNorm (Llama 2: 1e-6).", gt=0, msg=_POSITIVE_SHAPE
    )
    mlp: str = _f(
        "gelu",
        "MLP: gelu (up, GELU, down) | swiglu (down(silu(gate x) * up x), Llama; three matrices).",
    )
    ffn_hidden: int = _f(
        0,
        "MLP hidden width; 0: 4 x n_embd for gelu, and for swiglu 8/3 x n_embd rounded up to a multiple of 64 "
        "(LLaMA's rule: the parameters of a 4x GELU MLP in three matrices).",
        ge=0,
        msg=_DEFAULT_WIDTHS,
    )
    n_kv_head: int = _f(
        0,
        "Key/value heads; 0: n_head (multi-head). Fewer share each among n_head / n_kv_head query heads "
        "(grouped-query attention; 1: multi-query); must divide n_head. The KV cache holds only these.",
        ge=0,
        msg=_DEFAULT_WIDTHS,
    )
    qk_norm: bool = _f(False, "RMSNorm of each query and key head before RoPE (OLMo 2, Qwen 3, nanochat).")
    tie_embeddings: bool = _f(True, "The LM head shares the token embedding's weights (gpt2); false: own.")
    mup: bool = _f(
        False,
        "muP (Tensor Programs V, in the form of EleutherAI's practitioner's guide; loom.model.mup has the table): "
        "hidden matrices' init std / sqrt(m) and AdamW lr / m, logits * 1/m, attention q.k / D, with "
        "m = n_embd / model.mup_base_width; a learning rate tuned at the base width holds at wider ones.",
    )
    mup_base_width: int = _f(
        0, "model.mup: the n_embd the hyperparameters were tuned at (muP equals SP there).", ge=0
    )
    mtp_depth: int = _f(
        0,
        "Multi-token prediction (DeepSeek-V3): D sequential modules (a norm pair, a 2C->C projection and one "
        "block each) sharing the embedding and head, module k predicting the token k+1 ahead; training only "
        "(0: off; loom.model.mtp).",
        ge=0,
    )
    mtp_weight: float = _f(
        0.3, "model.mtp_depth: the MTP loss's weight lambda (loss + lambda / D * sum of the D losses).", ge=0
    )

    # A family's own keys (ModelSpec.keys: model.n_experts for moe, ...) live on `family_keys`, an instance of
    # the family's dataclass that config.io.apply_family makes; they read and write as model.<key> all the same.
    def __getattr__(self, name: str) -> Any:
        own = self.__dict__.get("family_keys")
        if own is not None and not name.startswith("__") and name in _field_names(own):
            return getattr(own, name)
        raise AttributeError(f"model.{name} is no key of model.family={self.__dict__.get('family')}")

    def __eq__(self, other: object) -> bool:  # the family's keys too
        return isinstance(other, ModelConfig) and self.__dict__ == other.__dict__

    def __setattr__(self, name: str, value: Any) -> None:
        own = self.__dict__.get("family_keys")
        if own is not None and name in _field_names(own):
            setattr(own, name, value)
            return
        object.__setattr__(self, name, value)
        if name == "family":  # another family: its own keys at their defaults (apply_family sets the rest)
            section = FAMILY_SECTIONS.get(value)
            keys = section.keys if section is not None else None
            if own is not None and not (keys and isinstance(own, keys)):
                # the other family's keys set away from their defaults wait for apply_family, which refuses them
                pending = self.__dict__.setdefault("pending", {})
                for f in dataclasses.fields(own):
                    if getattr(own, f.name) != f.default:
                        pending.setdefault(f.name, (getattr(own, f.name), False))
            if keys is None:
                self.__dict__.pop("family_keys", None)
            elif not isinstance(own, keys):
                self.__dict__["family_keys"] = keys()


@dataclass
class TrainConfig:
    steps: int = _f(1000, "Optimizer steps.", gt=0)
    time_budget_s: float = _f(
        0.0,
        "Choose train.steps from the speed measured here so that the steps take about this many seconds "
        "(0: off; never more than train.steps; decided after 10 steps, inside the LR warm-up; evaluations "
        "come on top). A fresh run only: config.toml then records the steps chosen (loom.train.budget).",
        ge=0,
    )
    batch_size: int = _f(
        16, "Global batch in sequences per optimizer step (all ranks, all micro-steps).", gt=0
    )
    micro_batch_size: int = _f(
        0,
        "Sequences per device per forward pass; 0: batch_size / dp (no accumulation).",
        ge=0,
        why="0: batch_size / dp",
    )
    batch_schedule: str = _f(
        "",
        "Batch-size warm-up: SIZE@STEP,... global batches in sequences, each from the step after STEP steps on "
        "(first at 0, last = train.batch_size), e.g. 8@0,16@200,32@400; more gradient-accumulation "
        "micro-batches, never larger ones. Each step reads the next windows in order (loom.config.schedules).",
    )
    seq_schedule: str = _f(
        "",
        "Sequence-length warm-up: LEN@STEP,... row lengths dividing model.block_size (first at 0, last = "
        "block_size), e.g. 64@0,128@100,256@300; the batch is kept in tokens (each window cut into "
        "block_size / LEN rows). Validation stays at block_size.",
    )
    eval_every: int = _f(200, "Evaluate validation loss every N steps (0: never; always at the end).", ge=0)
    eval_batches: int = _f(20, "Validation set size in global batches (a fixed set of sequences).", gt=0)
    ckpt_every: int = _f(500, "Write a checkpoint every N steps (0: only at the end).", ge=0)
    keep_last: int = _f(2, "Checkpoints kept on disk (older ones are deleted).", gt=0)
    ema: float = _f(
        0.0,
        "Decay of an exponential moving average of the weights, updated after each optimizer step "
        "(ema = decay * ema + (1 - decay) * weights; e.g. 0.999; 0: off). Its validation loss is recorded as "
        "val_loss_ema beside val_loss; checkpoints save it and a resume continues it exactly (loom.train.ema).",
        ge=0,
        lt=1,
    )
    log_every: int = _f(50, "Console line and metrics.jsonl record every N steps (0: never).", ge=0)
    sample_every: int = _f(500, "Print and save a sample every N steps (0: never; always at the end).", ge=0)
    sample_tokens: int = _f(200, "Tokens generated per sample.", ge=0)
    hellaswag_every: int = _f(
        0,
        "HellaSwag accuracy every N steps and at the end (0: never), from train.hellaswag_data; examples "
        "are split across the data-parallel ranks (as `loom eval --task hellaswag`).",
        ge=0,
    )
    hellaswag_data: str = _f("", "The HellaSwag JSONL (ctx, endings, label), e.g. hellaswag_val.jsonl.")
    hellaswag_limit: int = _f(0, "Score only the first N HellaSwag examples (0: all).", ge=0)
    compile: bool = _f(False, "torch.compile the model (compile time is excluded from throughput).")
    device: str = _f("auto", "auto (cuda > mps > cpu) | cpu | cuda | cuda:N | mps.")
    warmup_log_steps: int = _f(3, "First steps left out of the throughput summary (warm-up, compile).", ge=0)
    reuse_cpu_memory: bool = _f(
        True,
        "CPU on Linux: keep freed memory in the process while training (glibc malloc without mmap/trim), "
        "so large activations are not page-faulted in again every step (~20% faster steps on 10M params). "
        "Sharded layouts (fsdp, zero2, HSDP) give large blocks back instead: their gathered weights fragment the heap.",
    )
    activation_checkpointing: str = _f(
        "none",
        "Recompute activations in the backward pass, per block: none | full (keep only block inputs) | "
        "selective (keep matmul and attention outputs, recompute LayerNorm/GELU/adds).",
    )
    resume: str = _f(
        "no",
        "auto: continue run.dir/run.name from its newest valid checkpoint if it has one, else start it "
        "(needs run.name) | no: start a new run (--resume continues one).",
    )
    async_ckpt: str = _f(
        "auto",
        "Checkpoint in the background: auto (on for CUDA, off on CPU) | true | false. The step that starts a "
        "save only copies this rank's shards to host memory; writing, hashing and the rename go on in a "
        "thread at a low CPU priority (nice 10: little is taken from a loop that keeps every core busy), at "
        "most one save in flight (the next save, the last step and a stop signal wait for it).",
    )
    on_save_error: str = _f(
        "continue",
        "A checkpoint that cannot be written (too little free disk, I/O error): continue (warn, retry at the "
        "next save) | stop (exit with an error; earlier checkpoints are kept).",
    )
    max_bad_steps: int = _f(
        5,
        "A step with a NaN/Inf loss or gradient norm (or a loss spike) is skipped; after this many in a row "
        "the run saves its last good state and stops, naming the parameters with non-finite gradients.",
        gt=0,
    )
    spike_zscore: float = _f(
        0.0,
        "Loss-spike guard: skip a step whose loss is this many std devs above the recent mean (0: off; a spike "
        "of 6 std devs is then recorded, not skipped).",
        ge=0,
    )
    spike_window: int = _f(
        100,
        "Loss-spike guard: the number of recent good steps it compares against.",
        ge=2,
        why="a mean and a spread",
    )
    straggler_every: int = _f(
        100,
        "Multi-process runs: every N steps compare the ranks' phase times (data wait, forward, backward, "
        "comm, optimizer, the rest of the step, and the waits for peers inside collectives, apart from the "
        "compute; timed without extra synchronisation) in one small gather, name the rank the others wait "
        "for with its host, its excess over the others' median and the phase, and record every rank's times "
        "in metrics.jsonl (0: off).",
        ge=0,
    )
    straggler_threshold: float = _f(
        0.2,
        "Name the slowest rank when its excess over the per-phase medians is above this fraction of the "
        "median step time.",
        gt=0,
    )
    straggler_windows: int = _f(
        3, "Warn when the same rank is named slowest this many windows in a row.", ge=1
    )
    profile_start: int = _f(
        0,
        "torch.profiler: the first step traced (0: no profile); each chosen rank writes a Chrome trace of "
        "train.profile_steps steps, marked data, forward, backward, comm, optimizer and checkpoint, into "
        "RUN/profile/trace_step<first>-<last>_rank<r>.json (chrome://tracing or ui.perfetto.dev).",
        ge=0,
    )
    profile_steps: int = _f(3, "torch.profiler: the number of steps traced from train.profile_start.", ge=1)
    profile_ranks: str = _f("0", "torch.profiler: the ranks that write a trace: all, or a list such as 0,3.")
    memory_snapshot: str = _f(
        "off",
        "off | on_oom: record the device's allocation history and, when it runs out of memory, dump it into "
        "RUN/memory/ and exit with code 71 (view the file at pytorch.org/memory_viz) | steps: also dump at "
        "train.memory_snapshot_steps. On CUDA only a real history exists; elsewhere the file holds what the "
        "device can say (see loom.train.memory).",
    )
    memory_snapshot_steps: str = _f("", "train.memory_snapshot=steps: the steps dumped after, e.g. 5,100.")
    activation_offload: bool = _f(
        False,
        "Keep the activations the backward pass needs in host memory (pinned on a GPU, copied back for the "
        "backward): saved-tensor hooks, composable with activation checkpointing, FSDP, tp and pp; the same "
        "gradients, less device memory, some time for the copies.",
    )


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "Peak learning rate, reached after warmup_steps.", gt=0, msg=_LR, hint=_LR_HINT)
    min_lr: float = _f(
        MIN_LR_FOLLOWS,
        "Learning rate at the end of the decay; -1: lr / 10 (nanoGPT's rule, after Chinchilla), so it follows "
        "a changed optim.lr. A run's config.toml keeps the value it was given.",
        ge=0,
        also=MIN_LR_FOLLOWS,
        msg=_LR,
        hint=_LR_HINT,
    )
    warmup_steps: int = _f(100, "Linear warm-up steps.", ge=0)
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to >=2-D parameters only.", ge=0)
    beta1: float = _f(0.9, "AdamW beta1.", ge=0, lt=1, msg=_BETAS)
    beta2: float = _f(0.99, "AdamW beta2.", ge=0, lt=1, msg=_BETAS)
    eps: float = _f(1e-8, "AdamW epsilon.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value (0: no clipping).", ge=0)
    impl: str = _f("auto", "auto | torch-fused | torch-foreach | torch-loop | triton (one kernel launch).")
    name: str = _f(
        "adamw",
        "adamw | muon: Newton-Schulz-orthogonalised momentum for the 2-D hidden matrices (attention and MLP "
        "weights), AdamW (lr, betas, weight_decay) for embeddings, head, norms and biases (optim.impl ignored).",
    )
    muon_lr: float = _f(
        0.02,
        "optim.name=muon: peak learning rate of the hidden matrices (same schedule as lr).",
        gt=0,
        msg=_MUON,
    )
    muon_momentum: float = _f(
        0.95, "optim.name=muon: Nesterov momentum of the hidden matrices.", ge=0, lt=1, msg=_MUON
    )
    muon_ns_steps: int = _f(
        5,
        "optim.name=muon: Newton-Schulz iterations per step (5: singular values ~0.7-1.2).",
        ge=1,
        msg=_MUON,
    )
    muon_weight_decay: float = _f(
        0.0, "optim.name=muon: decoupled weight decay of the hidden matrices.", ge=0, msg=_MUON
    )
    muon_ns_dtype: str = _f(
        "fp32",
        "optim.name=muon: the Newton-Schulz iteration's dtype: fp32 (one matrix at a time) | bf16 (Keller Jordan's "
        "reference; the matrices of one shape as one batch: a third of the time on a CPU with bf16 units).",
    )
    schedule: str = _f(
        "cosine",
        "Learning-rate shape after warm-up: cosine (to min_lr at the last step) | wsd (warmup-stable-decay: "
        "hold lr, then fall linearly to min_lr over the last decay_frac of the steps).",
    )
    decay_frac: float = _f(
        0.3, "optim.schedule=wsd: fraction of train.steps spent in the final linear decay.", ge=0, le=1
    )
    state_dtype: str = _f(
        "",
        "AdamW's moment storage: empty (the parameters' dtype) | int8 | int4: torchao's low-bit AdamW "
        "(block-wise quantized moments, tensors of 4,096+ values; the rest stay full precision; optim.impl "
        "ignored; torchao, loom[fp8]).",
    )
    offload: str = _f(
        "none",
        "none | cpu: torchao's CPUOffloadOptimizer, the AdamW state and step on the host, gradients copied "
        "over each step (CUDA or XPU parameters only; one process).",
    )

    def end_lr(self) -> float:
        """The learning rate the decay ends at: min_lr, or lr / 10 when min_lr is MIN_LR_FOLLOWS (unset)."""
        return self.lr / 10 if self.min_lr == MIN_LR_FOLLOWS else self.min_lr


@dataclass
class PrecisionConfig:
    dtype: str = _f(
        "auto",
        "auto | fp32 | bf16 (autocast) | fp16 (autocast with dynamic loss scaling). auto, the default: bf16 "
        "where the device has bf16 units (GPUs since Ampere, CPUs with AVX512-BF16/AMX: 2.0-2.3x fp32's speed "
        "on the demo's model), fp16 on older GPUs, else fp32 (emulated bf16 is slower); the run's first lines "
        "say the choice. fp32 for exact comparisons.",
    )
    tf32: bool = _f(True, "CUDA: TF32 tensor cores for fp32 matmuls and convolutions (ignored on CPU).")
    init_scale: float = _f(65536.0, "fp16: initial loss scale (halved after each overflow step).", gt=0)
    growth_interval: int = _f(2000, "fp16: steps without overflow after which the loss scale doubles.", gt=0)
    fp8: str = _f(
        "off",
        "off | tensorwise | rowwise: FP8 matmuls in the chosen linears through torchao (the loom[fp8] extra), "
        "weights and optimizer in high precision; tensorwise also all-gathers FSDP weights in float8 "
        "(loom/parallel/fp8.py).",
    )
    fp8_filter: str = _f(
        "auto",
        "fp8: which linears. auto: those large enough to gain on H100 (torchao's measured thresholds); all: "
        "every linear whose dimensions are multiples of 16 (small models, CPU).",
    )
    fp8_head: bool = _f(False, "fp8: the LM head too (untied heads only); off, it stays high precision.")


@dataclass
class ParallelConfig:
    dp_impl: str = _f(
        "auto",
        "Data parallel: auto (ddp when world size > 1, else none) | none | ddp | zero1 | zero2 | fsdp | mpi.",
    )
    param_dtype: str = _f(
        "",
        "zero2/fsdp: dtype of gathered parameters for compute (fp32 | bf16 | fp16); empty: bf16 on GPUs when "
        "precision is bf16, else as stored.",
    )
    reduce_dtype: str = _f(
        "", "zero2/fsdp: dtype of the gradient reduce-scatter; empty: fp32 (the stored dtype)."
    )
    cpu_offload: bool = _f(
        False, "zero2/fsdp: keep sharded parameters, gradients and optimizer state in host memory."
    )
    mpi_sync: str = _f("bucketed", "dp_impl=mpi gradient sync: naive (Allreduce per parameter) | bucketed.")
    bucket_mb: float = _f(
        25.0,
        "dp_impl=mpi bucketed sync: bucket size in MiB (DDP's default is 25).",
        gt=0,
        msg="parallel.bucket_mb must be > 0, got {parallel.bucket_mb}",
        hint="e.g. 25 (DDP's default)",
    )
    mpi_allreduce: str = _f("mpi", "dp_impl=mpi bucketed sync: mpi (Iallreduce) | ring (loom's own ring).")
    timeout_s: float = _f(
        600.0, "A collective that does not complete in this many seconds is an error.", gt=0
    )
    dp_replicate: int = _f(
        1,
        "zero2/fsdp: replica groups of HSDP (replicate across nodes, shard within); 1: plain FSDP.",
        ge=1,
        msg=_HSDP,
    )
    dp_shard: int = _f(
        -1,
        "zero2/fsdp: ranks each parameter is sharded over; -1: world / (dp_replicate * cp * tp * pp).",
        ge=1,
        also=-1,
        msg=_HSDP,
    )
    tp: int = _f(
        1,
        "Tensor-parallel degree (Megatron column/row split); divides n_head. dp = world / (cp*tp*pp).",
        ge=1,
        msg=_DEGREES,
    )
    sp: bool = _f(False, "Sequence parallel (with tp > 1): LayerNorms and dropout run on sequence shards.")
    pp: int = _f(
        1,
        "Pipeline-parallel degree: the layers are cut into pp (or pp * stages per rank) stages.",
        ge=1,
        msg=_DEGREES,
    )
    cp: int = _f(
        1,
        "Context-parallel degree: each rank of a cp group holds block_size / cp tokens of every sequence (long "
        "contexts); ulysses: divides block_size and n_kv_head, ring: 2*cp divides block_size. "
        "dp = world / (cp*tp*pp).",
        ge=1,
        msg="parallel.cp must be >= 1; got {parallel.cp}",
    )
    cp_impl: str = _f(
        "ulysses",
        "cp > 1: ulysses (DeepSpeed-Ulysses: all-to-all from sequence to head shards around attention) | ring "
        "(ring attention: keys/values travel around the cp ranks, each rank holding two of 2*cp chunks).",
    )
    ep: int = _f(
        1,
        "Expert-parallel degree (model.family=moe): the routed experts are split over ep of the data-parallel x "
        "cp ranks, tokens travel to their experts by all-to-all; divides n_experts and dp x cp.",
        ge=1,
        msg="parallel.ep must be >= 1; got {parallel.ep}",
    )
    pp_schedule: str = _f("1f1b", "Pipeline schedule: gpipe | 1f1b | interleaved-1f1b | zero-bubble.")
    pp_microbatches: int = _f(
        0,
        "Micro-batches per pipeline step; 0: the local batch / train.micro_batch_size when that is set, else "
        "one per stage (pp; the smallest count >= pp that divides the local batch, a multiple of pp for the "
        "looped schedules).",
    )
    grad_compression: str = _f(
        "none",
        "dp_impl=ddp (or zero1): how the gradient all-reduce is sent, through PyTorch's DDP communication hooks: "
        "none | bf16 | fp16 (each bucket cast to half precision, half the bytes) | powersgd (Vogels et al. 2019: "
        "each gradient matrix as a rank-r product P Q^T with error feedback; vectors at full precision).",
    )
    powersgd_rank: int = _f(
        4, "grad_compression=powersgd: the rank r of each gradient matrix's approximation.", ge=1
    )
    powersgd_warmup: int = _f(
        10,
        "grad_compression=powersgd: steps of plain all-reduce before compressing (PyTorch's "
        "start_powerSGD_iter; >= 2, the error feedback needs one step of history).",
        ge=2,
    )
    diloco_inner_steps: int = _f(
        0,
        "DiLoCo (Douillard et al. 2023) across parallel.dp_replicate: each replica (ddp or fsdp inside) takes "
        "this many local optimizer steps, then every replica applies one outer step on the parameter change "
        "averaged over the replicas (one all-reduce of the parameters per this many steps); 0: off.",
        ge=0,
    )
    diloco_outer_lr: float = _f(
        0.7, "DiLoCo's outer learning rate (Nesterov SGD on the averaged change; the paper's 0.7).", gt=0
    )
    diloco_outer_momentum: float = _f(
        0.9, "DiLoCo's outer Nesterov momentum (the paper's 0.9; 0: plain SGD).", ge=0, lt=1
    )
    degree1_meshes: bool = _f(
        False,
        "One process: apply tensor, pipeline and context parallel at degree 1 on 1-rank meshes, so one GPU runs every "
        "code path (the GPU check, benchmarks/gpu_check.py); ignored with more processes.",
    )

    @property
    def cp_layout(self) -> str:
        """Which tokens of a sequence each cp rank holds (loom.data.loader.seq_chunk): ring attention's
        load-balanced zigzag, else consecutive chunks."""
        return "zigzag" if self.cp_impl == "ring" else "contiguous"


@dataclass
class MetricsConfig:
    tensorboard: bool = _f(False, "Also write TensorBoard event files to <run>/tensorboard (extra: track).")
    wandb: bool = _f(False, "Also log to Weights & Biases (extra: track); WANDB_MODE=offline logs locally.")
    wandb_project: str = _f("loom", "W&B project name.")
    detail: bool = _f(
        False,
        "GPUs: time each micro-batch's forward and backward (dtf, dtb) with CUDA events. Off, a GPU step "
        "records no dtf/dtb and never waits for the device inside a step (CPUs always record them: free).",
    )


@dataclass
class EvalConfig:
    """Capability evaluation in the training loop (loom.eval.capability): lm-evaluation-harness tasks and the
    CORE score, each record in metrics.jsonl (`loom eval RUN --tasks ...` scores a checkpoint the same way)."""

    tasks: str = _f(
        "",
        "lm-evaluation-harness tasks to score every eval.every steps and at the end (comma list, or a TOML "
        "list): its names (hellaswag, arc_easy, ...) or tasks of your own in eval.include_path (extra: eval).",
    )
    core_bundle: str = _f(
        "", "A CORE eval bundle folder (core.yaml, eval_data/): the CORE score is logged too."
    )
    every: int = _f(0, "Score the tasks every N steps and at the end (0: only at the end).", ge=0)
    limit: int = _f(
        0, "Examples per task (0: all). The harness takes the first N; CORE a seeded shuffle's.", ge=0
    )
    num_fewshot: int = _f(-1, "Few-shot examples per prompt (-1: each task's own number).", ge=-1)
    include_path: str = _f("", "A folder of task YAMLs of your own (the harness's --include_path).")
    batch_size: int = _f(16, "Sequences per forward pass when scoring.", gt=0)


@dataclass
class FinetuneConfig:
    """LoRA adapters for fine-tuning (loom.model.lora): the base model frozen, low-rank updates trained on the
    chosen linears, merged into the weights on export."""

    lora_rank: int = _f(0, "LoRA adapters' rank; 0: no LoRA (every parameter trains).", ge=0)
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the update is (alpha / rank) * B A.", gt=0)
    lora_targets: str = _f(
        "q_proj,v_proj",
        "Linears given adapters: names, dotted suffixes, patterns (blocks.*.attn.q_proj) or attn | mlp | "
        "all-linear; lm_head only by name.",
    )
    lora_dropout: float = _f(0.0, "Dropout on the adapters' input (training only).", ge=0, lt=1)
    init_optimizer: bool = _f(
        False,
        "With model.init_from=run:DIR, start from that run's optimizer state too (AdamW's moments and step "
        "count), as continued pretraining does; not with LoRA (other parameters train).",
    )
    lora_embeddings: str = _f(
        "auto",
        "With LoRA, the token embedding and the head train too: auto (when the data adds tokens to the model's "
        "vocabulary, as chat data's chat tokens: their rows start as the mean row, alike, and must learn) | "
        "true | false.",
    )
    quantize_base: str = _f(
        "none",
        "none | nf4: QLoRA, the frozen base's linears (not the head or a router) held as torchao's NF4 "
        "(4-bit NormalFloat, double-quantized scales: ~0.52 bytes a parameter), dequantized per matmul; needs "
        "finetune.lora_rank > 0, one process, weights whose sizes are multiples of 16,384, torchao (loom[fp8]).",
    )


@dataclass
class DPOConfig:
    """Preference tuning on preference pairs (`loom dpo`, loom.train.dpo): the loss against the reference
    model, the one the run starts from (model.init_from)."""

    beta: float = _f(
        0.1,
        "How far the policy may move from the reference: the scale of the log-ratio in the loss (sigmoid), or "
        "the inverse of twice IPO's target margin.",
        gt=0,
    )
    loss: str = _f(
        "sigmoid",
        "sigmoid: DPO's -log sigmoid(beta * margin) | ipo: (margin - 1 / (2 beta))^2 over per-token mean "
        "log-probabilities.",
    )


@dataclass
class RLConfig:
    """Reinforcement learning on verifiable rewards (`loom rl`, loom.rl): G answers per prompt sampled from the
    model, scored by a reward, group-relative advantages, a clipped policy-gradient step (GRPO, with DAPO's
    token-level normalisation). train.batch_size counts answers: prompts per step = batch_size / group_size."""

    prompts: str = _f("", "Prompts JSONL (messages or prompt, plus the reward's field); set: the RL stage.")
    eval_prompts: str = _f(
        "", "Held-out prompts JSONL: pass@1 (greedy) and pass@k every rl.eval_every steps."
    )
    reward: str = _f("exact", "exact | numeric | regex | module:function (a Sample -> float).")
    answer_field: str = _f("answer", "The prompt row's field the exact and numeric rewards compare with.")
    pattern: str = _f("", "rl.reward=regex: 1 when this regular expression matches the answer, else 0.")
    group_size: int = _f(8, "G: answers sampled per prompt (their rewards' group).", gt=0)
    max_new_tokens: int = _f(
        32, "Longest answer sampled, in tokens (prompt + this must fit block_size).", gt=0
    )
    adv_norm: str = _f("std", "Advantage: std ((r - mean) / std within the group) | mean (r - mean).")
    clip_low: float = _f(0.2, "The importance ratio is clipped below at 1 - clip_low.", ge=0, lt=1)
    clip_high: float = _f(0.28, "and above at 1 + clip_high (DAPO's clip-higher).", ge=0)
    updates_per_batch: int = _f(
        1, "Optimizer steps each rollout batch serves (> 1: the ratio matters).", gt=0
    )
    kl_coef: float = _f(0.0, "Weight of the k3 KL to the frozen start model (0: no reference).", ge=0)
    dynamic_sampling: bool = _f(True, "Drop groups whose rewards are all equal (no signal), counted.")
    batch_invariant: bool = _f(
        True, "CPU: the sampler's and trainer's forwards alike bit for bit (off on GPUs)."
    )
    eval_every: int = _f(0, "Held-out pass@1 / pass@k every N steps (0: only after the last).", ge=0)
    eval_k: int = _f(4, "k of pass@k: samples per held-out prompt at temperature 1 (0: greedy only).", ge=0)
    eval_limit: int = _f(0, "Held-out prompts scored (0: all).", ge=0)
    reward_timeout: float = _f(
        0.0,
        "Seconds a reward call may run (0: no bound); one past it is stopped (SIGALRM, main thread) and its "
        "sample dropped and counted, like a reward that raises.",
        ge=0,
    )
    max_dropped_steps: int = _f(
        20,
        "Stop the run with an error once this many steps in a row dropped every group (equal rewards in each: "
        "no advantage, nothing learned); 0: never.",
        ge=0,
    )
    stop: str = _f(
        "",
        "Texts that end an answer besides the end-of-text (and end-of-turn) token, separated by commas; escapes "
        "\\n \\t \\, (a base run's prompts: e.g. '\\n'). The answer's text is cut before it; its tokens train.",
    )
    is_cap: float = _f(
        2.0,
        "Where batch-invariance is off or the step runs in bf16/fp16 (exact only in fp32): each token's loss "
        "weighted by min(p_trainer / p_sampler, is_cap) "
        "(truncated importance sampling); 0: no correction.",
        ge=0,
    )
    max_staleness: int = _f(
        0,
        "Asynchronous rollouts (loom.rl.async_rollout): K > 0 samples each batch in a worker process of its own "
        "with the weights of exactly K steps before the step that trains on it (fewer at the start), while the "
        "trainer trains; rl.is_cap corrects the lag. 0: sample with the current weights, in the step.",
        ge=0,
    )
    sampler_threads: int = _f(
        0, "rl.max_staleness > 0: the rollout worker's torch threads (0: the trainer's count).", ge=0
    )
    env: str = _f(
        "",
        "Multi-turn episodes with an environment, module:Class (reset(row) -> str, step(text) -> (observation "
        "or None, reward, done); loom.rl.envs:Calculator is built in). Its tokens are context, never trained.",
    )
    max_turns: int = _f(4, "rl.env: model turns an episode may take (one not done by then is dropped).")
    max_episode_tokens: int = _f(
        0,
        "rl.env: tokens after the prompt an episode may hold, model's and environment's (0: the block's).",
        ge=0,
    )
    env_timeout_s: float = _f(
        10.0, "rl.env: seconds an environment call may take; one past it drops its episode (counted).", ge=0
    )


@dataclass
class FtConfig:
    """torchft fault tolerance (extra: ft; loom.distributed.ft): the data-parallel replicas become replica groups
    that a lighthouse keeps in a quorum; a group that dies leaves it, the others go on, and a restarted one
    heals from a live peer. See docs/operations.md."""

    enabled: bool = _f(False, "Train as torchft replica groups (one process each; loom train --nproc N).")
    replica_groups: int = _f(0, "Replica groups in the job (0: --nproc's number).", ge=0)
    replica_id: int = _f(
        -1, "This process's replica group (-1: set by --nproc; by hand: 0..groups-1).", ge=-1
    )
    lighthouse: str = _f(
        "", "A running lighthouse, http://HOST:PORT (empty: loom train --nproc starts one on 127.0.0.1)."
    )
    min_replicas: int = _f(1, "Replica groups a step needs to commit (the quorum's minimum).", gt=0)
    job_name: str = _f("", "The job's name on the lighthouse (empty: run.name).")
    timeout_s: float = _f(60.0, "Seconds a quorum, collective or heal may take before it is abandoned.", gt=0)
    heartbeat_s: float = _f(
        2.0,
        "Seconds without a heartbeat before the lighthouse loom starts drops a replica group from the quorum "
        "(how soon the others go on after a failure); the groups beat every tenth of it, at most every 0.1 s.",
        gt=0,
    )
    join_timeout_s: float = _f(
        10.0,
        "Seconds the lighthouse loom starts holds a new quorum for a live group that has not asked to join it "
        "yet (longer than a group's longest pause between steps: an evaluation, a checkpoint save).",
        gt=0,
    )
    max_restarts: int = _f(3, "loom train --nproc: times a failed replica group is started again.", ge=0)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    ft: FtConfig = field(default_factory=FtConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's keys; the model section's include its family's own keys (config.toml saves them)."""
        d = dataclasses.asdict(self)
        own = self.model.__dict__.get("family_keys")
        if own is not None:
            d["model"].update(dataclasses.asdict(own))
        return d


# Pipeline schedules, the one table: parallel.pp_schedule -> (its class in torch.distributed.pipelining, stages
# per pipeline rank: 2 for the looped placement, stage s on pipeline rank s mod pp)
PP_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "zero-bubble": ("ScheduleInterleavedZeroBubble", 2),
}
SCHEDULE_STAGES_PER_RANK = {name: per_rank for name, (_, per_rank) in PP_SCHEDULES.items()}

CHOICES = {
    ("data", "tokenizer"): ("char", "bpe"),
    ("data", "mix_repeat"): ("error", "warn", "allow"),
    ("model", "activation"): ("gelu_tanh", "gelu"),
    ("model", "pos"): ("learned", "rope"),
    ("model", "norm"): ("layernorm", "rmsnorm"),
    ("model", "mlp"): ("gelu", "swiglu"),
    ("optim", "impl"): ("auto", "torch-fused", "torch-foreach", "torch-loop", "triton"),
    ("optim", "name"): ("adamw", "muon"),
    ("optim", "schedule"): ("cosine", "wsd"),
    ("optim", "muon_ns_dtype"): ("fp32", "bf16"),
    ("optim", "state_dtype"): ("", "int8", "int4"),
    ("optim", "offload"): ("none", "cpu"),
    ("finetune", "quantize_base"): ("none", "nf4"),
    ("train", "resume"): ("no", "auto"),
    ("train", "on_save_error"): ("continue", "stop"),
    ("train", "async_ckpt"): ("auto", "true", "false"),
    ("train", "activation_checkpointing"): ("none", "full", "selective"),
    ("train", "memory_snapshot"): ("off", "on_oom", "steps"),
    ("precision", "dtype"): ("fp32", "bf16", "fp16", "auto"),
    ("precision", "fp8"): ("off", "tensorwise", "rowwise"),
    ("precision", "fp8_filter"): ("auto", "all"),
    ("data", "align"): ("none", "bos"),
    ("data", "doc_positions"): ("continue", "restart"),
    ("parallel", "dp_impl"): ("auto", "none", "ddp", "zero1", "zero2", "fsdp", "mpi"),
    ("parallel", "param_dtype"): ("", "fp32", "bf16", "fp16"),
    ("parallel", "reduce_dtype"): ("", "fp32", "bf16", "fp16"),
    ("parallel", "mpi_sync"): ("naive", "bucketed"),
    ("parallel", "grad_compression"): ("none", "bf16", "fp16", "powersgd"),
    ("parallel", "mpi_allreduce"): ("mpi", "ring"),
    ("parallel", "cp_impl"): ("ulysses", "ring"),
    ("parallel", "pp_schedule"): tuple(PP_SCHEDULES),
    ("dpo", "loss"): ("sigmoid", "ipo"),
    ("rl", "adv_norm"): ("std", "mean"),
}


# str keys that also take a TOML list of strings
LIST_KEYS = {"eval.tasks", "data.mix", "data.sources", "train.batch_schedule", "train.seq_schedule"}


def section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{f.name}" for s in section_types() for f in fields(getattr(cfg, s))]
