"""Configuration: one dataclass tree, a docstring per field (layer 0).

Resolution order: defaults -> TOML file -> `--section.key=value` overrides. Unknown sections or keys raise
a LoomError naming the closest valid key; values of the wrong type raise too. `validate(cfg, world)` is the
one check of a config against a world size: each field's bounds (declared on the field), the model's shape,
the parallel layout and the batch, each rule in one place; it returns the values printed at start (gradient
accumulation, tokens per step) and the layout (ParallelDims).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loom.errors import LoomError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


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
        "norm=rmsnorm, mlp=swiglu, tie_embeddings=false, bias=false) | moe (llama's, with n_experts=8 routed "
        "experts in the MLPs: the moe_* keys). A key set explicitly overrides the preset.",
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
    n_experts: int = _f(
        0,
        "model.family=moe: routed SwiGLU experts per MoE layer (the family's preset: 8); 0: dense.",
        ge=0,
    )
    moe_top_k: int = _f(2, "MoE: experts each token is routed to (at most n_experts).", ge=1)
    moe_every: int = _f(1, "MoE: every k-th layer after the first dense ones is a MoE layer.", ge=1)
    moe_first_dense: int = _f(0, "MoE: the first layers keep a dense MLP (DeepSeek-V3: 3).", ge=0)
    n_shared_experts: int = _f(0, "MoE: shared experts every token passes through (DeepSeek: 1).", ge=0)
    moe_ffn_hidden: int = _f(
        0, "MoE: an expert's hidden width; 0: the dense MLP's (ffn_hidden's rule).", ge=0
    )
    moe_score: str = _f("softmax", "MoE router scores: softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3).")
    moe_aux_loss_coef: float = _f(
        0.0,
        "MoE: weight of the sequence-wise load-balancing loss (Switch/GShard form; ~1e-3 to 1e-2); 0: none.",
        ge=0,
    )
    moe_bias_update_rate: float = _f(
        0.0,
        "MoE: DeepSeek-V3's auxiliary-loss-free balancing: each step every expert's routing bias moves by this "
        "towards the mean load (~1e-3); 0: none.",
        ge=0,
    )
    moe_gemm: str = _f(
        "auto",
        "MoE experts' matmuls: auto (one grouped GEMM where torch._grouped_mm runs, else a loop) | grouped | "
        "loop.",
    )


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
    eval_every: int = _f(200, "Evaluate validation loss every N steps (0: never; always at the end).", ge=0)
    eval_batches: int = _f(20, "Validation set size in global batches (a fixed set of sequences).", gt=0)
    ckpt_every: int = _f(500, "Write a checkpoint every N steps (0: only at the end).", ge=0)
    keep_last: int = _f(2, "Checkpoints kept on disk (older ones are deleted).", gt=0)
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
        "Loss-spike guard: skip a step whose loss is this many std devs above the recent mean (0: off).",
        ge=0,
    )
    spike_window: int = _f(
        100,
        "Loss-spike guard: the number of recent good steps it compares against.",
        ge=2,
        why="a mean and a spread",
    )


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "Peak learning rate, reached after warmup_steps.", gt=0, msg=_LR)
    min_lr: float = _f(1e-4, "Learning rate at the end of the cosine decay.", ge=0, msg=_LR)
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
    schedule: str = _f(
        "cosine",
        "Learning-rate shape after warm-up: cosine (to min_lr at the last step) | wsd (warmup-stable-decay: "
        "hold lr, then fall linearly to min_lr over the last decay_frac of the steps).",
    )
    decay_frac: float = _f(
        0.3, "optim.schedule=wsd: fraction of train.steps spent in the final linear decay.", ge=0, le=1
    )


@dataclass
class PrecisionConfig:
    dtype: str = _f(
        "fp32",
        "fp32 | bf16 (autocast) | fp16 (autocast with dynamic loss scaling) | auto (bf16 where the device "
        "has bf16 units: GPUs since Ampere, CPUs with AVX512-BF16/AMX; fp16 on older GPUs; else fp32).",
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
        0, "Micro-batches per pipeline step; 0: the local batch / train.micro_batch_size."
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

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


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
    ("model", "activation"): ("gelu_tanh", "gelu"),
    ("model", "pos"): ("learned", "rope"),
    ("model", "norm"): ("layernorm", "rmsnorm"),
    ("model", "mlp"): ("gelu", "swiglu"),
    ("optim", "impl"): ("auto", "torch-fused", "torch-foreach", "torch-loop", "triton"),
    ("optim", "name"): ("adamw", "muon"),
    ("optim", "schedule"): ("cosine", "wsd"),
    ("train", "resume"): ("no", "auto"),
    ("train", "on_save_error"): ("continue", "stop"),
    ("train", "async_ckpt"): ("auto", "true", "false"),
    ("train", "activation_checkpointing"): ("none", "full", "selective"),
    ("precision", "dtype"): ("fp32", "bf16", "fp16", "auto"),
    ("precision", "fp8"): ("off", "tensorwise", "rowwise"),
    ("precision", "fp8_filter"): ("auto", "all"),
    ("data", "align"): ("none", "bos"),
    ("data", "doc_positions"): ("continue", "restart"),
    ("parallel", "dp_impl"): ("auto", "none", "ddp", "zero1", "zero2", "fsdp", "mpi"),
    ("parallel", "param_dtype"): ("", "fp32", "bf16", "fp16"),
    ("parallel", "reduce_dtype"): ("", "fp32", "bf16", "fp16"),
    ("parallel", "mpi_sync"): ("naive", "bucketed"),
    ("parallel", "mpi_allreduce"): ("mpi", "ring"),
    ("parallel", "cp_impl"): ("ulysses", "ring"),
    ("parallel", "pp_schedule"): tuple(PP_SCHEDULES),
}


LIST_KEYS = {"eval.tasks"}  # str keys that also take a TOML list of strings


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}


def all_keys() -> list[str]:
    cfg = Config()
    return [f"{s}.{f.name}" for s in _sections() for f in fields(getattr(cfg, s))]


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(options)}"


def _coerce(key: str, value: Any, default: Any, from_text: bool) -> Any:
    """Check (TOML) or parse (command line) a value against the type of the field's default."""
    kind = type(default)
    if from_text:
        text = str(value)
        try:
            if kind is bool:
                low = text.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return low in ("true", "1", "yes")
            if kind is int:
                return int(text.replace("_", ""))
            if kind is float:
                return float(text)
            return text
        except ValueError:
            raise LoomError(
                f"config key '{key}' expects {kind.__name__}, got '{text}'",
                hint=f"for example --{key}={default}",
            ) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (
        kind is str
        and key in LIST_KEYS
        and isinstance(value, list)
        and all(isinstance(v, str) for v in value)
    ):
        return ",".join(value)  # a TOML list of names, kept as the comma list the command line gives
    if type(value) is not kind:
        raise LoomError(
            f"config key '{key}' expects {kind.__name__}, got {type(value).__name__} ({value!r})",
            hint=f"for example {key.split('.')[-1]} = {default!r}".replace("'", '"'),
        )
    return value


def set_key(cfg: Config, key: str, value: Any, from_text: bool = False) -> None:
    """Set `section.key` on cfg, with the unknown-key and type checks."""
    if "." not in key:
        raise LoomError(f"config key '{key}' needs a section", hint=_suggest(key, all_keys()))
    section, name = key.split(".", 1)
    if section not in _sections():
        raise LoomError(f"unknown config section '{section}'", hint=_suggest(section, list(_sections())))
    sub = getattr(cfg, section)
    names = [f.name for f in fields(sub)]
    if name not in names:
        raise LoomError(
            f"unknown config key '{key}'", hint=_suggest(key, [f"{section}.{n}" for n in names] + all_keys())
        )
    value = _coerce(key, value, getattr(sub, name), from_text)
    choices = CHOICES.get((section, name))
    if (section, name) == ("model", "family"):  # the registered families (loom.model.registry, plug-ins too)
        choices = tuple(FAMILIES)
    if choices and value not in choices:
        hint = "a plug-in family is loaded by naming its module in LOOM_PLUGINS" if name == "family" else None
        raise LoomError(f"config key '{key}' must be one of {', '.join(choices)}; got '{value}'", hint=hint)
    setattr(sub, name, value)


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "does not exist"  # a folder, /dev/zero, a FIFO
        raise LoomError(f"config file '{p}' {what}", hint="give the path of a .toml file")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LoomError(f"config file '{p}' is not valid TOML: {e}") from None
    except OSError as e:
        raise LoomError(f"cannot read config file '{p}': {e.strerror or e}") from None


def apply_dict(cfg: Config, data: dict[str, Any]) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise LoomError(
                f"config entry '{section}' must be a [section] table",
                hint=_suggest(section, list(_sections())),
            )
        for name, value in values.items():
            set_key(cfg, f"{section}.{name}", value)


def explicit_keys(config_path: str | None, overrides: list[str]) -> set[str]:
    """The keys a user set ("section.key"), in the config file or as --section.key=value overrides: they win
    over what a resumed run or model.init_from would set, and a conflict with those is an error."""
    keys = {k for k, _ in parse_overrides(overrides)}
    if config_path:
        keys |= {f"{s}.{k}" for s, kv in load_toml(config_path).items() for k in kv}
    return keys


def config_argv(argv: list[str], config_arg: str | None, rest: list[str]) -> tuple[str | None, list[str]]:
    """(config file, overrides) of a command with an optional config-file positional and --section.key=value
    overrides (`rest`: what argparse left): an override argparse took for the file goes back to the
    overrides, and `--train.steps 5` (no '=': the 5 read as the file) is refused, naming the fix."""
    rest = list(rest)
    if config_arg and config_arg.startswith("--"):
        return None, [config_arg, *rest]
    for i, a in enumerate(argv[1:], 1):
        prev = argv[i - 1]
        if config_arg and a == config_arg and prev.startswith("--") and "." in prev and "=" not in prev:
            raise LoomError(
                f"'{a}' after {prev} was taken for the config file: an override before the "
                f"config file needs '=' ({prev}={a})",
                hint=f"write {prev}={a}",
            )
    return config_arg, rest


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--model.n_layer=4', '--train.steps', '10'] into [(key, text)] pairs."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise LoomError(
                f"unrecognised argument '{a}'", hint="config overrides look like --section.key=value"
            )
        if "=" in a:
            k, v = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise LoomError(f"override '{a}' has no value", hint=f"write {a}=VALUE")
            k, v = a[2:], args[i + 1]
            i += 1
        out.append((k, v))
        i += 1
    return out


# model.family presets: the model keys each family sets, unless the TOML or the command line sets them.
# The built-in families' are here so that a config parses without the model package; a plug-in family adds
# its own when it registers (loom.model.registry.register).
FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "tie_embeddings": True},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False, "bias": False},
}
FAMILIES["moe"] = {**FAMILIES["llama"], "n_experts": 8}


def apply_family(cfg: Config, explicit: set[str]) -> None:
    """Set model.family's preset keys, except those in `explicit` ('model.pos', ...: set by the user)."""
    for k, v in FAMILIES[cfg.model.family].items():
        if f"model.{k}" not in explicit:
            setattr(cfg.model, k, v)


def _keys(data: dict[str, Any]) -> set[str]:
    return {f"{s}.{k}" for s, values in data.items() if isinstance(values, dict) for k in values}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """defaults -> TOML file -> overrides (then model.family's preset for the model keys neither set)."""
    cfg = Config()
    data = load_toml(path) if path else {}
    apply_dict(cfg, data)
    pairs = parse_overrides(overrides or [])
    for k, v in pairs:
        set_key(cfg, k, v, from_text=True)
    explicit = _keys(data) | {k for k, _ in pairs}
    apply_family(cfg, explicit)
    if "model.activation" in explicit and cfg.model.mlp == "swiglu":  # set, and nothing reads it
        from loom import log

        log.warn(
            f"model.activation={cfg.model.activation} is not used: model.mlp=swiglu gates with SiLU "
            "(model.activation is the gelu MLP's); leave it out, or set model.mlp=gelu to use it"
        )
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    apply_dict(cfg, data)
    apply_family(cfg, _keys(data))
    return cfg


def _toml_string(s: str) -> str:
    """A TOML basic string: quote and backslash escaped, and the control characters TOML forbids raw
    (U+0000-U+001F but tab, U+007F) as \\uXXXX, so a name with a newline still reads back."""
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif (ord(c) < 0x20 and c != "\t") or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def to_toml(cfg: Config) -> str:
    """Write the resolved config as TOML (flat sections of scalars, so a tiny writer suffices)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if isinstance(v, bool):
                text = "true" if v else "false"
            elif isinstance(v, (int, float)):
                text = repr(v)
            else:
                text = _toml_string(str(v))
            lines.append(f"{k} = {text}")
        lines.append("")
    return "\n".join(lines)


def diff_configs(a: Config, b: Config, sections: tuple[str, ...] | None = None) -> list[str]:
    """Keys whose values differ, as 'key: a -> b'."""
    da, db = a.to_dict(), b.to_dict()
    out = []
    for s in da:
        if sections and s not in sections:
            continue
        for k in da[s]:
            if da[s][k] != db[s][k]:
                out.append(f"{s}.{k}: {da[s][k]!r} -> {db[s][k]!r}")
    return out


# model.* keys that do not change what a trained model computes: where its first weights came from, and
# dropout, which evaluation, sampling and export switch off.
_NOT_THE_MODEL = ("init_from", "dropout")


# finetune.* keys that change what a checkpoint holds or what its model computes (LoRA's adapters, their scale,
# which linears carry them, whether the embedding and head train); lora_dropout changes training only, and
# init_optimizer acts at a run's start only
_FINETUNE_MODEL = ("lora_rank", "lora_alpha", "lora_targets", "lora_embeddings")
_FINETUNE_TRAINING = ("lora_dropout",)


def check_model_config(
    saved: dict, cfg: Config, source: str, hint: str, *, inference: bool = False, finetune: dict | None = None
) -> None:
    """The one check of a saved model against a config: `saved` is the "model" section a checkpoint recorded
    (state.json, or a consolidated file's metadata; a key it lacks, newer than the save, counts as its
    default), `finetune` its "finetune" section when it recorded one. Every key that differs is named
    (saved -> config; inference: the run's and the checkpoint's values) in a LoomError ("`source` was trained
    with another model shape: ...", with `hint`). inference: only the keys that change the shapes or the
    numerics of a forward pass (not _NOT_THE_MODEL; finetune's _FINETUNE_MODEL); training (resume) compares
    every model key and finetune's _FINETUNE_TRAINING too."""
    # a resume changes the config from the saved one (saved -> config); a finished run's config.toml should
    # say what its checkpoint holds (run vs checkpoint)
    say = (
        (lambda k, a, b: f"{k}: {b!r} in the run, {a!r} in the checkpoint")
        if inference
        else (lambda k, a, b: f"{k}: {a!r} -> {b!r}")
    )
    mine = cfg.to_dict()
    diff = _differing("model", saved, mine["model"], lambda k: not (inference and k in _NOT_THE_MODEL))
    if finetune is not None:
        keys = _FINETUNE_MODEL + (() if inference else _FINETUNE_TRAINING)
        diff += _differing("finetune", finetune, mine["finetune"], lambda k: k in keys)
    if diff:
        what = "another model shape" if diff[0][0].startswith("model.") else "other fine-tuning settings"
        raise LoomError(f"{source} was trained with {what}: " + "; ".join(say(*d) for d in diff), hint=hint)


def check_saved_config(saved: dict, cfg: Config, source: str, hint: str, *, inference: bool = False) -> None:
    """check_model_config of a checkpoint's whole recorded config (state.json's "config"): model.* and
    finetune.*."""
    check_model_config(
        saved.get("model", {}), cfg, source, hint, inference=inference, finetune=saved.get("finetune")
    )


def _differing(section: str, saved: dict, mine: dict, compared) -> list[tuple[str, object, object]]:
    """(section.key, saved value, config value) of each compared key that differs; a key the save lacks (newer
    than it) counts as its default."""
    defaults = Config().to_dict()[section]
    saved = {**defaults, **{k: v for k, v in saved.items() if k in defaults}}
    return [(f"{section}.{k}", saved[k], v) for k, v in mine.items() if compared(k) and saved[k] != v]


def help_text() -> str:
    cfg = Config()
    rows = []
    for s in _sections():
        rows.append(f"[{s}]")
        for f in fields(getattr(cfg, s)):
            d = getattr(getattr(cfg, s), f.name)
            rows.append(f"  {s}.{f.name} = {d!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(rows)


@dataclass(frozen=True)
class Derived:
    """Values computed from the config and the world: printed at start, used by the trainer."""

    dp_size: int
    grad_accum: int
    tokens_per_step: int
    micro_batch_size: int
    pp_microbatches: int = 1  # with pp > 1 the schedule splits the local batch; grad_accum is then 1


SHARDED = ("fsdp", "zero2")  # dp_impl values that shard parameters over dp_shard (FSDP2)
WRAPPERS = ("ddp", "zero1", "zero2", "fsdp")  # dp_impl values with a torch wrapper (applied even on 1 rank)


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout of a job as a value: degrees, this rank's coordinates, and the device mesh. Built by
    validate() (here, in layer 0, so that the degrees it checked are the ones returned); the parallel package
    imports it as loom.parallel.dims.ParallelDims.

    Degrees, outermost first (torchtitan's order): pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is innermost
    so its frequent collectives stay among neighbouring ranks (one node), and context parallel's all-to-alls
    next to it; dp_replicate is outside dp_shard so HSDP shards within a node and replicates across nodes (Zhao
    et al. 2023, PyTorch FSDP). The data-parallel degree is dp = dp_replicate * dp_shard: the number of
    different batch shards read at each step (the cp ranks of one dp rank read the same rows, each a chunk).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    rank: int = 0
    dp_impl: str = "none"  # none | ddp | zero1 | zero2 | fsdp | mpi
    degree1: bool = False  # parallel.degree1_meshes: tp and pp applied at degree 1 in a 1-process job
    cp: int = 1  # context parallel: the ranks that split each sequence (between dp_shard and tp)
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp x cp ranks (innermost ones)

    def __post_init__(self):
        if self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp != self.world_size:
            raise LoomError(
                f"dp_replicate x dp_shard x cp x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.cp} x "
                f"{self.tp} x {self.pp} is not the world size {self.world_size}"
            )

    # ----------------------------------------------------------------------------- derived degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        """Data parallel is applied: more than one replica, or a 1-process job that asked for a wrapper by
        name (dp_impl=ddp|zero1|zero2|fsdp; `auto` gives `none` there), which then runs the same code on a
        1-rank group: how one GPU exercises every NCCL path (benchmarks/gpu_check.py)."""
        return self.dp > 1 or (self.world_size == 1 and self.dp_impl in WRAPPERS)

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards the parameters (over dp_shard x cp: the cp ranks of a data-parallel rank hold the same
        parameters, so they share the shards, as in torchtitan)."""
        return self.dp_impl in SHARDED and (self.dp_enabled or self.cp_enabled)

    @property
    def fsdp_shard(self) -> int:
        """The ranks each parameter is sharded over when FSDP is applied: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1 or self.degree1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1 or self.degree1

    @property
    def cp_enabled(self) -> bool:
        """Context parallel is applied: cp > 1, or at degree 1 with parallel.degree1_meshes (one GPU runs
        its code on a 1-rank group)."""
        return self.cp > 1 or self.degree1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallel: the model itself is split, not only the batch."""
        return self.tp_enabled or self.pp_enabled

    # ----------------------------------------------------------------------------- this rank
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        """Which chunk of each sequence this rank holds (tokens cp_rank * T/cp .. (cp_rank + 1) * T/cp - 1)."""
        return (self.rank // self.tp) % self.cp

    @property
    def dp_shard_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return (self.rank // (self.tp * self.cp * self.dp_shard)) % self.dp_replicate

    @property
    def dp_rank(self) -> int:
        """Which batch shard this rank reads."""
        return self.dp_replicate_rank * self.dp_shard + self.dp_shard_rank

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def is_main(self) -> bool:
        """The rank that logs and writes files."""
        return self.rank == 0

    def build_mesh(self, device_type: str):
        """The job's DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); every sub-group is created here, once."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        if self.cp_enabled:  # FSDP's shard dimension with context parallel: mesh["dp_shard_cp"]
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh

    def describe(self) -> str:
        dp = f"dp {self.dp} ({self.dp_impl}"
        if self.hsdp_enabled:
            dp += f": replicate {self.dp_replicate} x shard {self.dp_shard}"
        cp = f" | cp {self.cp}" if self.cp > 1 else ""
        ep = f" | ep {self.ep}" if self.ep > 1 else ""
        return dp + f"){cp}{ep} | tp {self.tp} | pp {self.pp}"

    def __str__(self) -> str:
        return (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            + (f"cp={self.cp} " if self.cp > 1 else "")
            + (f"ep={self.ep} " if self.ep > 1 else "")
            + f"tp={self.tp} pp={self.pp} rank={self.rank}"
        )


def validate(
    cfg: Config, world: int = 1, rank: int = 0, dp_impl: str | None = None
) -> tuple[Derived, ParallelDims]:
    """Every rule that can be checked before data or devices are touched, each in one place, in this order:
    each field's bounds (its metadata), the model's shape, the mesh of `world` processes (world = dp x cp x tp x pp),
    the data-parallel implementation (`dp_impl`, default parallel.dp_impl; auto resolved here), the batch.
    Returns the derived values printed at start and the layout of `rank`."""
    _check_fields(cfg)
    _check_model_shape(cfg.model)
    _check_doc_mask(cfg)
    _check_cp(cfg, dp_impl or cfg.parallel.dp_impl)
    dp = _check_mesh(cfg, world)
    impl = _resolve_dp_impl(cfg, world, dp, dp_impl)
    _check_moe(cfg, dp, impl)
    _check_fp8(cfg)
    _check_eval(cfg)
    _check_lora(cfg)
    replicate, shard = _dp_degrees(cfg.parallel, dp, impl)
    derived = _derive_batch(cfg, dp)
    p = cfg.parallel
    return derived, ParallelDims(
        replicate, shard, p.tp, p.pp, world, rank, impl, p.degree1_meshes and world == 1, p.cp, p.ep
    )


def _check_moe(cfg: Config, dp: int, dp_impl: str) -> None:
    """Mixture-of-experts keys and expert parallelism: the family, k of E, ep over the data-parallel x cp ranks,
    and what the balance loss and the expert split compose with."""
    m, p = cfg.model, cfg.parallel
    if m.family != "moe":
        if m.n_experts or p.ep > 1:
            raise LoomError(
                f"model.n_experts / parallel.ep are for model.family=moe; the family is '{m.family}'",
                hint="set model.family=moe (a Llama-shaped model with routed experts), or leave them unset",
            )
        return
    if m.n_experts < 1:
        raise LoomError("model.family=moe needs model.n_experts >= 1", hint="e.g. model.n_experts=8")
    if m.moe_top_k > m.n_experts:
        raise LoomError(
            f"model.moe_top_k={m.moe_top_k} is more than model.n_experts={m.n_experts}",
            hint=f"route each token to at most {m.n_experts} experts",
        )
    if m.moe_first_dense >= m.n_layer:
        raise LoomError(
            f"model.moe_first_dense={m.moe_first_dense} leaves no MoE layer among {m.n_layer}",
            hint=f"use moe_first_dense < {m.n_layer}",
        )
    for key, choices in (("moe_score", ("softmax", "sigmoid")), ("moe_gemm", ("auto", "grouped", "loop"))):
        if getattr(m, key) not in choices:
            raise LoomError(f"model.{key} must be one of {', '.join(choices)}; got '{getattr(m, key)}'")
    if m.moe_gemm == "grouped" and cfg.train.compile and cfg.precision.dtype in ("fp32", "fp16"):
        raise LoomError(
            f"model.moe_gemm=grouped with train.compile in {cfg.precision.dtype}: the grouped GEMM compiles in "
            "bf16 only (its meta function refuses other types)",
            hint="use model.moe_gemm=auto (the loop where grouped cannot run), or precision.dtype=bf16",
        )
    if m.moe_aux_loss_coef and p.pp > 1:
        raise LoomError(
            "model.moe_aux_loss_coef > 0 is not supported with pipeline parallel (the balance loss of earlier "
            "stages cannot join the last stage's loss)",
            hint="balance with model.moe_bias_update_rate (DeepSeek-V3's auxiliary-loss-free way) instead",
        )
    if m.moe_aux_loss_coef and p.cp > 1:
        raise LoomError(
            "model.moe_aux_loss_coef > 0 is not supported with context parallel (the loss is per sequence, and "
            "each cp rank holds a part of each)",
            hint="balance with model.moe_bias_update_rate instead",
        )
    if p.ep == 1:
        return
    if m.n_experts % p.ep:
        raise LoomError(
            f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts} (each rank holds whole experts)",
            hint="pick ep among the divisors of n_experts: " + _divisors(m.n_experts),
        )
    if (dp * p.cp) % p.ep:
        raise LoomError(
            f"parallel.ep={p.ep} does not divide the data-parallel x cp ranks, {dp} x {p.cp} (expert parallelism "
            "splits the experts over those ranks)",
            hint="pick ep among the divisors of " + f"{dp * p.cp}: " + _divisors(dp * p.cp),
        )
    if dp_impl not in ("ddp", "fsdp", "zero2"):
        raise LoomError(
            f"parallel.ep > 1 does not compose with parallel.dp_impl={dp_impl}",
            hint="use parallel.dp_impl=ddp or fsdp (or zero2) with expert parallelism",
        )


def _check_eval(cfg: Config) -> None:
    """eval.*: lm-evaluation-harness found (not imported: loom.eval.capability imports it when the trainer
    starts, and checks the task names and data there, before the model is built)."""
    e = cfg.eval
    if not (e.tasks.strip(" ,") or e.core_bundle):
        if e.every:
            raise LoomError(
                f"eval.every={e.every} has nothing to score: eval.tasks and eval.core_bundle are empty",
                hint="name tasks (--eval.tasks=hellaswag,arc_easy) or a CORE bundle, or set eval.every=0",
            )
        return
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise LoomError(
            "eval.tasks / eval.core_bundle need lm-evaluation-harness, which is not installed",
            hint="install the eval extra: pip install 'loom[eval]'",
        )


def _check_lora(cfg: Config) -> None:
    """finetune.lora_*: what adapters compose with (their targets are checked against the model when it is
    built: loom.model.lora.apply_lora)."""
    f = cfg.finetune
    if f.lora_embeddings not in ("auto", "true", "false"):
        raise LoomError(f"finetune.lora_embeddings must be auto, true or false; got '{f.lora_embeddings}'")
    if f.init_optimizer and (not cfg.model.init_from.startswith("run:") or f.lora_rank):
        raise LoomError(
            "finetune.init_optimizer=true takes the optimizer state of the run model.init_from=run:DIR names, "
            f"for the same parameters; here model.init_from='{cfg.model.init_from}', finetune.lora_rank="
            f"{f.lora_rank}",
            hint="use it with model.init_from=run:DIR and full fine-tuning (finetune.lora_rank=0)",
        )
    if not f.lora_rank:
        return
    if cfg.precision.fp8 != "off":
        raise LoomError(
            "finetune.lora_rank > 0 with precision.fp8: torchao's Float8Linear replaces the adapted linears "
            "and would drop their adapters",
            hint="fine-tune LoRA in bf16 (precision.fp8=off)",
        )


def _check_fp8(cfg: Config) -> None:
    """What rules precision.fp8 out from the config alone: torchao missing (found, not imported: it is imported
    only by the model's conversion, loom/parallel/fp8.py), a precision or head it does not compose with. A GPU
    without float8 tensor cores: loom.parallel.fp8.check_device, once the device is known."""
    p = cfg.precision
    if p.fp8 == "off":
        return
    if p.dtype == "fp16":
        raise LoomError(
            "precision.fp8 with precision.dtype=fp16: float8 training runs beside bf16 or fp32 (no loss scaling)",
            hint="use precision.dtype=bf16",
        )
    if p.fp8_head and cfg.model.tie_embeddings:
        raise LoomError(
            "precision.fp8_head=true but the head is the token embedding (model.tie_embeddings=true): the "
            "embedding is a lookup torchao does not convert, and the shared weight cannot be both",
            hint="leave precision.fp8_head=false, or untie the head (a Llama family)",
        )
    if p.fp8_head and cfg.parallel.tp > 1:
        raise LoomError(
            "precision.fp8_head=true with parallel.tp > 1 is not supported: the vocabulary-parallel head masks "
            "its shard of the logits in place, which the float8 matmul's output does not allow",
            hint="leave precision.fp8_head=false under tensor parallel",
        )
    if importlib.util.find_spec("torchao") is None:
        raise LoomError(
            f"precision.fp8={p.fp8} needs torchao, which is not installed",
            hint="install loom's fp8 extra: pip install 'loom[fp8]' (torchao >= 0.18), or precision.fp8=off",
        )


def _within(v: Any, bounds: Any) -> bool:
    if "also" in bounds and v == bounds["also"]:
        return True
    low = v > bounds["gt"] if "gt" in bounds else v >= bounds.get("ge", v)
    high = v < bounds["lt"] if "lt" in bounds else v <= bounds.get("le", v)
    return low and high


def _bound_message(key: str, v: Any, bounds: Any) -> str:
    if "lt" in bounds or "le" in bounds:  # an interval
        low = f"({bounds['gt']}" if "gt" in bounds else f"[{bounds['ge']}"
        high = f"{bounds['lt']})" if "lt" in bounds else f"{bounds['le']}]"
        return f"{key} must be in {low}, {high}, got {v}"
    if "gt" in bounds:
        return f"{key} must be " + ("positive" if bounds["gt"] == 0 else f"> {bounds['gt']}") + f", got {v}"
    why = f" ({bounds['why']})" if "why" in bounds else ""
    return f"{key} must be >= {bounds['ge']}{why}, got {v}"


def _check_fields(cfg: Config) -> None:
    """Every field against its bounds (read from its metadata; floats also against nan and inf, which TOML and
    float() accept), then the rules between two fields."""
    sections = {s: getattr(cfg, s) for s in _sections()}
    for s, sub in sections.items():
        for f in fields(sub):
            key, v = f"{s}.{f.name}", getattr(sub, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise LoomError(f"{key} must be a finite number, got {v}")
            if not _within(v, f.metadata):
                msg = f.metadata["msg"].format(**sections) if "msg" in f.metadata else None
                raise LoomError(msg or _bound_message(key, v, f.metadata), hint=f.metadata.get("hint"))
    t = cfg.train
    if cfg.optim.min_lr > cfg.optim.lr:
        raise LoomError(_LR.format(**sections))
    if t.hellaswag_every and not t.hellaswag_data:
        raise LoomError(
            f"train.hellaswag_every={t.hellaswag_every} needs train.hellaswag_data (a HellaSwag JSONL)",
            hint="give --train.hellaswag_data=hellaswag_val.jsonl, or set train.hellaswag_every=0",
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_model_shape(m: ModelConfig) -> None:
    """Heads divide the width; the rules of the Llama-family options (grouped-query heads, RoPE's pairs)."""
    if m.n_embd % m.n_head:
        raise LoomError(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}",
            hint=f"pick n_embd as a multiple of n_head, e.g. {m.n_head * max(1, m.n_embd // m.n_head)}",
        )
    if m.n_kv_head and m.n_head % m.n_kv_head:
        raise LoomError(
            f"model.n_head={m.n_head} is not divisible by model.n_kv_head={m.n_kv_head} (each key/value head "
            "serves the same number of query heads)",
            hint="pick n_kv_head among the divisors of n_head: " + _divisors(m.n_head),
        )
    if m.pos == "rope" and (m.n_embd // m.n_head) % 2:
        raise LoomError(
            f"model.pos=rope needs an even head size; n_embd / n_head = {m.n_embd // m.n_head}",
            hint="change n_embd or n_head",
        )


def _check_doc_mask(cfg: Config) -> None:
    """data.doc_mask's rules: the documents are found in the input ids, which only the first pipeline stage
    sees; restarting positions need the documents."""
    d = cfg.data
    if d.doc_positions == "restart" and not d.doc_mask:
        raise LoomError(
            "data.doc_positions=restart needs data.doc_mask=true (positions restart at each document)",
            hint="add --data.doc_mask=true, or leave data.doc_positions=continue",
        )
    if d.doc_mask and cfg.parallel.pp > 1:
        raise LoomError(
            f"data.doc_mask=true is not supported with parallel.pp={cfg.parallel.pp}: the documents are found "
            "in the input ids, which later pipeline stages do not see",
            hint="use data.doc_mask=false, or parallel.pp=1 (tensor and data parallel work with it)",
        )


def _check_cp(cfg: Config, dp_impl: str) -> None:
    """Context parallel's rules (parallel.cp > 1): the sequence splits evenly (into 2 * cp chunks for ring),
    Ulysses' all-to-all splits the heads evenly, and the layouts and features not built with it yet are
    refused by name."""
    p, m, cp = cfg.parallel, cfg.model, cfg.parallel.cp
    if cp == 1:
        return
    if p.cp_impl == "ring":
        _check_ring(cfg)
    elif m.block_size % cp:
        raise LoomError(
            f"parallel.cp={cp} does not divide model.block_size={m.block_size} (each cp rank holds "
            "block_size / cp tokens of every sequence)",
            hint="pick cp among the divisors of block_size: " + _divisors(m.block_size),
        )
    kv = m.n_kv_head or m.n_head
    if p.cp_impl == "ulysses" and kv % (cp * p.tp):
        tp = f" x parallel.tp={p.tp}" if p.tp > 1 else ""
        per_tp = kv // p.tp if kv % p.tp == 0 else kv
        raise LoomError(
            f"parallel.cp={cp}{tp} with cp_impl=ulysses does not divide model.n_kv_head={kv} (Ulysses gives each "
            "cp rank whole key/value heads of the whole sequence, out of its tensor-parallel rank's heads)",
            hint=f"pick cp among the divisors of {per_tp} ({_divisors(per_tp)}), or use more key/value heads, "
            "or parallel.cp_impl=ring",
        )
    if p.sp and m.block_size % (cp * p.tp):
        raise LoomError(
            f"parallel.sp with cp={cp}: model.block_size={m.block_size} is not divisible by cp x tp = "
            f"{cp * p.tp} (sequence parallel splits each cp rank's chunk over the tp ranks)",
            hint="pick block_size, cp and tp so that cp x tp divides block_size",
        )
    if dp_impl == "mpi":
        raise LoomError(
            "parallel.cp > 1 does not compose with parallel.dp_impl=mpi (its exchanges run on torch.distributed)",
            hint="use parallel.dp_impl=ddp (or auto) with context parallel",
        )
    if dp_impl == "zero1":
        raise LoomError(
            "parallel.cp > 1 does not compose with parallel.dp_impl=zero1 (its optimizer shards over the "
            "data-parallel group; FSDP shards over dp_shard x cp)",
            hint="use parallel.dp_impl=fsdp (or zero2, or ddp) with context parallel",
        )
    if cfg.train.hellaswag_every:
        raise LoomError(
            "train.hellaswag_every does not run with parallel.cp > 1 yet (its forward passes are whole sequences)",
            hint="set train.hellaswag_every=0 and score the run afterwards with `loom eval`",
        )


def _check_ring(cfg: Config) -> None:
    """Ring attention's own rules: its load-balanced layout cuts every sequence into 2 * cp chunks, and
    what it does not build (document masks, dropout of the attention weights) is refused by name."""
    m, cp = cfg.model, cfg.parallel.cp
    if m.block_size % (2 * cp):
        fits = [str(d) for d in range(2, m.block_size // 2 + 1) if m.block_size % (2 * d) == 0]
        raise LoomError(
            f"parallel.cp={cp} with cp_impl=ring needs 2*cp = {2 * cp} to divide model.block_size="
            f"{m.block_size} (each cp rank holds two of 2*cp equal chunks of every sequence, one early and one "
            "late, so that causal attention costs every rank the same)",
            hint="pick cp among "
            + (", ".join(fits) or "(none: block_size is odd)")
            + ", or change block_size",
        )
    if cfg.data.doc_mask:
        raise LoomError(
            "data.doc_mask=true is not supported with parallel.cp_impl=ring (the ring's masks are causal only)",
            hint="use parallel.cp_impl=ulysses with document masks, or data.doc_mask=false",
        )
    if m.dropout:
        raise LoomError(
            f"model.dropout={m.dropout} is not supported with parallel.cp_impl=ring (the ring does not drop "
            "attention weights)",
            hint="use model.dropout=0, or parallel.cp_impl=ulysses",
        )


def _check_mesh(cfg: Config, world: int) -> int:
    """The data-parallel degree of `world` processes (tp innermost), after every rule of tensor and pipeline
    parallel."""
    p, m = cfg.parallel, cfg.model
    if world % (p.cp * p.tp * p.pp):
        raise LoomError(
            f"world size {world} is not divisible by parallel.cp x tp x pp = {p.cp} x {p.tp} x {p.pp}",
            hint=f"start a multiple of {p.cp * p.tp * p.pp} processes, or change cp/tp/pp",
        )
    if m.n_head % p.tp:
        raise LoomError(
            f"parallel.tp={p.tp} does not divide model.n_head={m.n_head} (each rank holds whole heads)",
            hint="pick tp among the divisors of n_head: " + _divisors(m.n_head),
        )
    kv = m.n_kv_head or m.n_head
    if kv % p.tp:
        raise LoomError(
            f"parallel.tp={p.tp} does not divide model.n_kv_head={kv} (each rank holds whole key/value heads)",
            hint="pick tp among the divisors of n_kv_head: " + _divisors(kv),
        )
    if p.sp and p.tp == 1:
        raise LoomError(
            "parallel.sp=true needs parallel.tp > 1 (sequence parallel shards what TP replicates)"
        )
    if p.sp and m.block_size % p.tp:
        raise LoomError(f"parallel.sp: model.block_size={m.block_size} is not divisible by tp={p.tp}")
    stages = p.pp * (SCHEDULE_STAGES_PER_RANK[p.pp_schedule] if p.pp > 1 else 1)
    if m.n_layer < stages:
        raise LoomError(
            f"{stages} pipeline stages (pp={p.pp}, schedule {p.pp_schedule}) but only model.n_layer="
            f"{m.n_layer} layers: every stage needs at least one",
            hint="lower parallel.pp, use the gpipe or 1f1b schedule, or add layers",
        )
    if p.degree1_meshes and world == 1 and SCHEDULE_STAGES_PER_RANK[p.pp_schedule] > 1:
        raise LoomError(  # two local stages: torch's schedule cannot evaluate them
            f"parallel.degree1_meshes takes a 1-stage schedule; pp_schedule={p.pp_schedule} puts two "
            "stages on the one rank, which torch's schedule cannot evaluate",
            hint="use parallel.pp_schedule=1f1b or gpipe",
        )
    if cfg.precision.dtype == "fp16" and p.pp > 1:
        raise LoomError(
            "precision.dtype=fp16 (loss scaling) is not supported with pp > 1",
            hint="use bf16 or fp32 with pipeline parallel",
        )
    return world // (p.cp * p.tp * p.pp)


def _resolve_dp_impl(cfg: Config, world: int, dp: int, dp_impl: str | None) -> str:
    """The data-parallel implementation `world` processes run: auto is ddp with more than one process (or a
    split model), else none; none with a split model and no data parallelism runs ddp's code on 1-rank groups."""
    p = cfg.parallel
    impl = dp_impl or p.dp_impl
    split = p.tp * p.pp > 1 or (p.degree1_meshes and world == 1)  # the model is split (or at degree 1)
    if impl == "none" and dp > 1:
        raise LoomError(
            f"{world} processes with parallel.dp_impl=none leave a data-parallel degree of {dp}",
            hint="use parallel.dp_impl=ddp (or auto), or start "
            + ("one process" if p.tp * p.pp == 1 else f"tp x pp = {p.tp * p.pp} processes"),
        )
    if p.tp * p.pp > 1 and impl in ("zero1", "mpi"):
        raise LoomError(
            f"parallel.dp_impl={impl} does not compose with tp/pp",
            hint="use parallel.dp_impl=ddp or fsdp (or zero2) with tensor/pipeline parallel",
        )
    if impl == "auto":
        return "ddp" if world > 1 or split else "none"
    # a split model, or cp ranks (which average their gradients), run ddp's code even at dp = 1
    return "ddp" if impl == "none" and (split or p.cp > 1) else impl


def _dp_degrees(p: ParallelConfig, dp: int, dp_impl: str) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a data-parallel degree dp: HSDP's split for fsdp/zero2 (dp_shard=-1 takes
    what dp_replicate leaves); every other implementation replicates over all of dp."""
    if dp_impl not in SHARDED:
        if p.dp_shard not in (-1, 1) or p.dp_replicate != 1:
            raise LoomError(
                f"parallel.dp_replicate/dp_shard split FSDP's data-parallel ranks (HSDP); dp_impl={dp_impl} "
                "replicates the model on every data-parallel rank",
                hint="use parallel.dp_impl=fsdp (or zero2) for HSDP, or leave dp_replicate/dp_shard unset",
            )
        return dp, 1
    shard = dp // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * shard != dp:
        raise LoomError(
            f"parallel.dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} must equal the data-parallel degree "
            f"{dp} (world / (tp x pp))",
            hint="pick dp_replicate among the divisors of " + f"{dp} and leave dp_shard=-1",
        )
    return p.dp_replicate, shard


def _derive_batch(cfg: Config, dp_size: int) -> Derived:
    """Gradient accumulation, or with pp > 1 the schedule's micro-batches, from the global batch over dp_size
    data-parallel ranks."""
    t, p = cfg.train, cfg.parallel
    if t.batch_size % dp_size:
        raise LoomError(
            f"train.batch_size={t.batch_size} is not divisible by the data-parallel size {dp_size}",
            hint=f"use a batch_size that is a multiple of {dp_size}, or fewer processes",
        )
    micro = t.micro_batch_size or t.batch_size // dp_size
    per_step = micro * dp_size
    if t.batch_size % per_step:
        raise LoomError(
            f"train.batch_size={t.batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size}"
            f" x data-parallel size {dp_size} = {per_step}",
            hint="make batch_size a multiple of micro_batch_size * dp (gradient accumulation fills the rest)",
        )
    tokens = t.batch_size * cfg.model.block_size
    if p.pp == 1:
        return Derived(dp_size, t.batch_size // per_step, tokens, micro)
    # Pipeline: the schedule's micro-batches replace gradient accumulation.
    local = t.batch_size // dp_size
    n_mb = p.pp_microbatches or local // micro
    if n_mb < 1 or local % n_mb:
        raise LoomError(f"parallel.pp_microbatches={n_mb} does not divide the local batch {local}")
    if p.pp_schedule != "gpipe" and n_mb < p.pp:
        raise LoomError(
            f"{n_mb} pipeline micro-batches for {p.pp} stages: schedule {p.pp_schedule} needs at least one per "
            "stage",
            hint=f"set parallel.pp_microbatches >= {p.pp} (or a smaller train.micro_batch_size)",
        )
    if SCHEDULE_STAGES_PER_RANK[p.pp_schedule] > 1 and n_mb % p.pp:  # the looped schedules
        raise LoomError(f"schedule {p.pp_schedule} needs pp_microbatches ({n_mb}) divisible by pp={p.pp}")
    return Derived(dp_size, 1, tokens, local // n_mb, n_mb)
