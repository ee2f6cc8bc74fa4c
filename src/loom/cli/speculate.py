"""The options `loom generate` and `loom serve` share for speculative decoding and quantized weights
(loom.engine.speculative, loom.model.quant): added to a parser, checked before anything loads, and the
speculator built for a loaded run."""

from __future__ import annotations

import argparse
from pathlib import Path

from loom.errors import LoomError

SPECULATE_HELP = (
    "speculative decoding of greedy answers (the same tokens, fewer forwards): 'ngram' drafts from the context "
    "(prompt lookup), 'mtp' with the run's own multi-token-prediction modules (model.mtp_depth; slow: no cache "
    "yet); --draft RUN drafts with a smaller run of the same tokenizer"
)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=["ngram", "mtp"], default=None, help=SPECULATE_HELP)
    p.add_argument(
        "--draft",
        default=None,
        metavar="RUN",
        help="a smaller run with the same tokenizer that drafts tokens",
    )
    p.add_argument("--spec-tokens", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument(
        "--quantize", choices=["int8"], default=None, help="int8 weight-only linear layers (torchao)"
    )


def check_options(args: argparse.Namespace) -> None:
    """Bad speculation or quantization options, and a draft run whose tokenizer is not the run's: LoomError
    before either model loads."""
    from loom.model.quant import check_quantize

    check_quantize(args.quantize)
    if args.spec_tokens < 1:
        raise LoomError(f"--spec-tokens must be at least 1, got {args.spec_tokens}")
    if args.speculate and args.draft:
        raise LoomError(f"--speculate {args.speculate} and --draft RUN are two drafters: give one")
    if args.draft:
        check_draft(args.run_dir, args.draft)


def _tokenizer(run_dir: str):
    from loom.data.loader import read_meta
    from loom.data.tokenizers import has_tokenizer, load_tokenizer, run_tokenizer_dir

    if not (Path(run_dir) / "config.toml").is_file():
        raise LoomError(
            f"'{run_dir}' is not a loom run directory (no config.toml)", hint="give a runs/<name> folder"
        )
    meta = read_meta(run_tokenizer_dir(Path(run_dir)))
    return load_tokenizer(Path(run_dir) / "tokenizer", meta) if has_tokenizer(meta) else None


def check_draft(run_dir: str, draft_dir: str) -> None:
    """The draft must read and write the run's token ids: the same vocabulary size, and the same text for
    every id (all of them up to 4096, else 2048 spread over the vocabulary, and end-of-text)."""
    tok, draft = _tokenizer(run_dir), _tokenizer(draft_dir)
    hint = "draft with a run trained on data of the run's tokenizer (the same `loom data prepare` tokenizer)"
    if tok is None or draft is None:
        raise LoomError(f"--draft {draft_dir}: both runs need a tokenizer to be compared", hint=hint)
    if tok.vocab_size != draft.vocab_size:
        raise LoomError(
            f"--draft {draft_dir} has another vocabulary: {draft.vocab_size} tokens, the run's has "
            f"{tok.vocab_size}",
            hint=hint,
        )
    V = tok.vocab_size
    ids = range(V) if V <= 4096 else range(0, V, max(1, V // 2048))
    for i in [*ids, tok.eot_id]:
        if _text(tok, i) != _text(draft, i):
            raise LoomError(
                f"--draft {draft_dir} has another vocabulary: token {i} is {_text(draft, i)!r} there, "
                f"{_text(tok, i)!r} in the run",
                hint=hint,
            )
    if getattr(draft, "eot_id", None) != tok.eot_id:
        raise LoomError(f"--draft {draft_dir} ends texts with another token id", hint=hint)


def _text(tok, i: int) -> str | None:
    try:
        return tok.decode([i])
    except Exception:  # noqa: BLE001  (an id that is a piece of a character alone)
        return None


def speculator_for(args: argparse.Namespace, device, model):
    """The speculator the options ask for (None: none) for the run's `model`: a draft run loaded on `device` and
    quantized as the run is (one whose context is shorter than the run's cannot draft for every row), or the
    model's own MTP modules."""
    from loom.engine.speculative import DraftProposer, MTPProposer, NgramProposer

    block_size = model.cfg.block_size
    if args.speculate == "ngram":
        return NgramProposer()
    if args.speculate == "mtp":
        from loom.model.mtp import mtp_depth

        if not mtp_depth(model):
            raise LoomError(
                "--speculate mtp drafts with the run's multi-token-prediction modules, and it has none",
                hint="train with --model.mtp_depth=N (N >= 1), or use --speculate ngram or --draft RUN",
            )
        return MTPProposer(model)
    if not args.draft:
        return None
    from loom.model.cpu_paths import inference_layout
    from loom.model.quant import quantize_weights
    from loom.runs import load_run

    _, model, _, _, _ = load_run(args.draft, device)
    if model.cfg.block_size < block_size:
        raise LoomError(
            f"--draft {args.draft} reads {model.cfg.block_size} tokens, the run {block_size}: it cannot draft "
            "for its longer rows",
            hint="draft with a run of at least the run's model.block_size",
        )
    inference_layout(model)
    quantize_weights(model, args.quantize)
    return DraftProposer(model)
