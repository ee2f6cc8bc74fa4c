"""`loom data`: prepare (text, or conversations with --chat), convert and inspect token data."""

from __future__ import annotations

import argparse

from loom.cli.args import refuse_options
from loom.errors import LoomError

# `loom data`'s verbs, each with the line `loom data --help` shows
DATA_VERBS = {
    "prepare": "text files, folders or JSONL (or --chat conversations, --pairs preferences) -> tokenizer + "
    "train/val shards",
    "convert": "token data between formats (llm.c's shards, nanoGPT's .bin, .npy, Megatron's): a folder or "
    "one file",
    "inspect": "what a token folder or file holds (format detected; --mix: a mixture's epochs per source)",
    "tokenizer": "tokenizer convert IN --to hf|gpt2|tiktoken OUT: a tokenizer in another library's format",
}


def data(argv: list[str]) -> int:
    if argv and argv[0] in ("convert", "inspect"):
        from loom.data.convert import data_convert_main, data_inspect_main

        return (data_convert_main if argv[0] == "convert" else data_inspect_main)(argv[1:])
    if argv and argv[0] == "tokenizer":
        return _tokenizer(argv[1:])
    p = argparse.ArgumentParser(
        prog="loom data",
        description="Prepare, convert and inspect token data.",
        epilog="each verb's options: loom data prepare --help, loom data convert --help, loom data inspect "
        "--help, loom data tokenizer convert --help",
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(DATA_VERBS) + "}")
    pp = sub.add_parser("prepare", help=DATA_VERBS["prepare"])
    for verb in ("convert", "inspect", "tokenizer"):  # parsed by their own modules (above): listed here
        sub.add_parser(verb, help=DATA_VERBS[verb], add_help=False)
    _add_inputs(pp)
    _add_text_options(pp)
    _add_chat_options(pp)
    args = p.parse_args(argv)
    if args.chat or args.pairs:
        flag, what = (
            ("--pairs", "preference pairs (JSONL lines of prompt, chosen and rejected, or of messages)")
            if args.pairs
            else (
                "--chat",
                "conversations (JSONL lines, or Parquet rows, of messages or of prompt and completion)",
            )
        )
        refuse_options(
            pp,
            argv[1:],
            _TEXT_ONLY,
            f"of plain-text preparation, which {flag} does not read",
            f": {flag} reads each --input file as {what}",
        )
        return _prepare_chat(args, flag)
    if args.block_size is not None or args.too_long is not None or args.chat_template is not None:
        raise LoomError(
            "--block-size, --too-long and --chat-template are options of --chat",
            hint="add --chat, or leave them out",
        )
    return _prepare_text(args)


def _tokenizer(argv: list[str]) -> int:
    """`loom data tokenizer convert IN --to hf|gpt2|tiktoken OUT` (loom.data.tokenizer_formats)."""
    from loom.data.tokenizer_formats import FORMATS

    p = argparse.ArgumentParser(prog="loom data tokenizer", description="Convert tokenizer files.")
    sub = p.add_subparsers(dest="verb", required=True)
    c = sub.add_parser("convert", help="write a tokenizer in another library's format")
    c.add_argument(
        "src",
        help="a tokenizer.json, a folder with one or with gpt2's files, a .tiktoken file or a sentencepiece "
        ".model (--to hf only)",
    )
    c.add_argument("--to", required=True, choices=FORMATS, help="hf (tokenizer.json) | gpt2 | tiktoken")
    c.add_argument("out", help="the folder to write into (new or empty)")
    c.add_argument("--force", action="store_true", help="write into a folder that already holds files")
    args = p.parse_args(argv)
    from loom import log
    from loom.data.tokenizers import convert_tokenizer, load_given_tokenizer

    files = convert_tokenizer(args.src, args.to, args.out, args.force)
    tok = load_given_tokenizer(files[0] if args.to == "tiktoken" else files[0].parent)
    written = ", ".join(str(f) for f in files)
    log.info(f"wrote {written}: vocab {tok.vocab_size:,}, end of text {tok.eot!r} = id {tok.eot_id}")
    return 0


def _add_inputs(pp) -> None:
    """The sources, the output and the first options of `prepare` (in --help's order)."""
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help="files, folders (recursive), .jsonl(.gz/.zst) or .parquet")
    src.add_argument("--corpus", help="a built-in corpus: python-stdlib")
    pp.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    pp.add_argument(
        "--tokenizer",
        default="char",
        help="char | bpe | PATH/tokenizer.json | a sentencepiece .model | a .tiktoken file (its pattern and "
        "special tokens in FILE.json beside it) | a folder with tokenizer.json, tokenizer.model or gpt2's "
        "encoder.json + vocab.bpe (default char)",
    )
    pp.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    pp.add_argument("--val-fraction", type=float, default=0.1, help="share of the text for val (default 0.1)")
    pp.add_argument(
        "--split-mode",
        default="docs",
        choices=["docs", "tail"],
        help="docs: whole documents by seeded shuffle; tail: last characters (nanogpt)",
    )
    pp.add_argument(
        "--jsonl-field",
        default="text",
        help="JSONL field / Parquet column holding the text; a dotted name reaches into objects (meta.text)",
    )
    pp.add_argument("--glob", default="*", help="file pattern inside folders, e.g. '*.py' (default *)")
    pp.add_argument("--seed", type=int, default=1337)
    pp.add_argument("--force", action="store_true", help="replace an existing output directory")
    pp.add_argument("--workers", type=int, default=0, help="encoding processes (default: every usable core)")
    pp.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)")


def _add_text_options(pp) -> None:
    """Options of plain-text preparation only (_TEXT_ONLY: refused beside --chat)."""
    pp.add_argument(
        "--tokenizer-sample",
        type=int,
        default=200_000_000,
        help="characters of train text the BPE is trained on (default 200M)",
    )
    pp.add_argument("--doc-cap", type=int, default=10_000, help="characters per document in that sample")
    pp.add_argument(
        "--split-pattern", default="gpt2", choices=["gpt2", "gpt4"], help="BPE pre-tokenizer split"
    )
    pp.add_argument(
        "--bpe-trainer",
        default="auto",
        choices=["auto", "rustbpe", "tokenizers"],
        help="BPE training library (auto: rustbpe when installed)",
    )
    pp.add_argument("--text-separator", default=None, help="cut text files into documents at this string")
    pp.add_argument("--doc-chars", type=int, default=0, help="cut text files into documents of ~N characters")
    pp.add_argument("--strict", action="store_true", help="a bad JSONL line or corrupt file is an error")
    pp.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token dtype")
    pp.add_argument(
        "--encoder",
        default="auto",
        choices=["auto", "tiktoken", "tokenizers"],
        help="BPE encoding library (auto: tiktoken when it gives the same ids)",
    )


def _add_chat_options(pp) -> None:
    chat = pp.add_argument_group("conversations for fine-tuning (--chat)")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="--input is conversations ({messages: [...]} or {prompt, completion}) in JSONL (.gz, .zst) or "
        "Parquet: shards + loss masks "
        "+ the tokenizer with chat tokens; --tokenizer may also be a run directory (the model to fine-tune)",
    )
    chat.add_argument(
        "--pairs",
        action="store_true",
        help="--input is preference pairs ({prompt, chosen, rejected}, or messages for the prompt) for loom dpo: "
        "chat data of each pair's two answers (the chat options apply); --tokenizer the chat model to tune",
    )
    chat.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="with --chat: the model's context length (default: the run's, when --tokenizer is a run directory)",
    )
    chat.add_argument(
        "--too-long",
        default=None,
        choices=["drop", "truncate"],
        help="with --chat: a conversation longer than --block-size + 1 tokens is dropped (default) or cut",
    )
    chat.add_argument(
        "--chat-template",
        default=None,
        choices=["loom", "tokenizer"],
        help="with --chat: loom's template with its chat tokens added (default), or the Jinja chat_template of "
        "the HF tokenizer folder --tokenizer DIR (Llama 3, Qwen; nothing added; needs loom[hf])",
    )


def _check_text(args) -> None:
    """What prepare() would refuse only after reading (and tokenizing) the whole corpus, refused first."""
    from loom.paths import check_not_endless, check_output_dir

    for path in args.input or []:
        check_not_endless(path, "--input")
    check_output_dir(args.out, "--out", temp_beside=True)  # written beside it first, then renamed
    if not 0.0 < args.val_fraction < 1.0:
        raise LoomError(f"--val-fraction must be between 0 and 1, got {args.val_fraction}")
    if args.tokenizer not in ("char", "bpe"):
        from loom.data.tokenizers import tokenizer_files

        tokenizer_files(args.tokenizer)  # a tokenizer.json, a folder with one, or gpt2's vocabulary files


def _prepare_text(args) -> int:
    """loom data prepare: text -> tokenizer + token shards (loom.data.prepare), after every cheap check."""
    _check_text(args)
    from loom.data.corpus import corpus_files
    from loom.data.prepare import prepare

    inputs = corpus_files(args.corpus) if args.corpus else args.input
    prepare(
        inputs,
        args.out,
        args.tokenizer,
        args.vocab_size,
        args.val_fraction,
        args.split_mode,
        args.jsonl_field,
        args.glob,
        args.seed,
        args.force,
        source=f"built-in corpus {args.corpus}" if args.corpus else None,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        tokenizer_sample=args.tokenizer_sample,
        doc_cap=args.doc_cap,
        pattern=args.split_pattern,
        bpe_trainer=args.bpe_trainer,
        text_separator=args.text_separator,
        doc_chars=args.doc_chars,
        strict=args.strict,
        dtype=args.dtype,
        encoder=args.encoder,
    )
    return 0


# `loom data prepare` options that conversations (--chat) have no use for: refused beside it, not ignored
_TEXT_ONLY = (
    "split_mode",
    "jsonl_field",
    "glob",
    "workers",
    "shard_tokens",
    "tokenizer_sample",
    "doc_cap",
    "split_pattern",
    "bpe_trainer",
    "text_separator",
    "doc_chars",
    "strict",
    "dtype",
    "encoder",
)


def _prepare_chat(args, flag: str) -> int:
    """loom data prepare --chat (conversations) or --pairs (preference pairs): shards + loss masks
    (loom.data.chat_prepare, loom.data.pairs). `flag`: the one given, as errors name it."""
    from loom.paths import check_output_dir

    if args.corpus:
        raise LoomError(f"{flag} reads JSONL, not a built-in corpus", hint="use --input FILE.jsonl")
    from loom.data.chat_prepare import check_tokenizer_spec, prepare_chat, run_block_size
    from loom.data.messages import check_inputs

    # the tokenizer first: a missing run folder is named as such, not as a missing --block-size it would give
    check_tokenizer_spec(args.tokenizer, args.vocab_size, args.chat_template or "loom")
    block_size = args.block_size
    if block_size is None:  # a run to fine-tune knows its context length
        block_size = run_block_size(args.tokenizer)
        if block_size is None:
            raise LoomError(
                f"{flag} needs --block-size (the context length of the model to fine-tune)",
                hint="e.g. --block-size 1024, or --tokenizer RUN_DIR to take the run's; conversations longer "
                "than it are dropped (or cut: --too-long truncate)",
            )
        from loom import log

        log.info(
            f"--block-size {block_size}: the model.block_size of run '{args.tokenizer}' (its config.toml)"
        )
    check_inputs(args.input)
    check_output_dir(args.out, "--out", temp_beside=True)
    if args.pairs:  # preference pairs (loom.data.pairs)
        from loom.data.pairs import prepare_pairs as prepare_chat
    prepare_chat(
        args.input,
        args.out,
        args.tokenizer,
        block_size,
        args.too_long or "drop",
        args.val_fraction,
        args.seed,
        args.force,
        vocab_size=args.vocab_size,
        chat_template=args.chat_template or "loom",
    )
    return 0
