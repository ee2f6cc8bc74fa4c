"""LoRA SFT of a transformers Llama (issue 34), against the model itself before and after export.

A tiny LlamaForCausalLM made here (random weights, a byte-level BPE tokenizer trained here whose vocabulary
leaves room for the chat tokens below the model's vocab_size) is fine-tuned with LoRA on chat data prepared with
its tokenizer; the run's adapters unmerged (loom's model with lora_A/lora_B, as trained) and the export (merged
into the weights, loaded by transformers) give the same logits (1e-5, fp32), and transformers' chat template
renders a conversation as loom's chat data does.
"""

from __future__ import annotations

import json

import pytest
import torch

from loom.cli import main

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")


def _byte_bpe(text: str):
    """A byte-level BPE (about 290 ids, <|endoftext|> among them) trained on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text] * 50, trainer=trainer)
    return tok


def _write_reversals(path, word_lists) -> None:
    """Conversations asking to reverse each word list, as JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for w in word_lists:
            msgs = [{"role": "user", "content": "reverse: " + " ".join(w)}]
            f.write(
                json.dumps({"messages": [*msgs, {"role": "assistant", "content": " ".join(w[::-1])}]}) + "\n"
            )


def _tiny_llama(d):
    tok = _byte_bpe("reverse: apple river stone cloud green house music paper")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,  # room for loom's 6 chat tokens after the tokenizer's ids (as Llama 3's reserved ones)
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return tok.get_vocab_size()


def test_lora_on_an_hf_llama_merged_export_equals_the_unmerged_model(tmp_path):
    from loom import checkpoint
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import read_meta
    from loom.model.lora import apply_configured, is_lora_name
    from loom.model.registry import spec_of
    from loom.runs import frozen_base

    hf_dir = tmp_path / "llama"
    n_tok = _tiny_llama(hf_dir)
    words = (["apple", "river"], ["stone", "cloud", "green"], ["house", "music"], ["paper", "apple"])
    _write_reversals(tmp_path / "conv.jsonl", words * 10)
    chat = tmp_path / "chat"
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(tmp_path / "conv.jsonl"),
                "--out",
                str(chat),
                "--tokenizer",
                str(hf_dir / "tokenizer.json"),
                "--block-size",
                "64",
            ]
        )
        == 0
    )
    assert read_meta(chat)["vocab_size"] == n_tok + 6
    run = tmp_path / "runs" / "lora"
    args = [
        "train",
        f"--data.path={chat}",
        f"--model.init_from=hf:{hf_dir}",
        f"--run.dir={tmp_path / 'runs'}",
        "--run.name=lora",
        "--model.block_size=64",
        "--finetune.lora_rank=4",
        "--finetune.lora_alpha=8",
        "--finetune.lora_targets=all-linear",
        "--train.steps=4",
        "--optim.lr=2e-2",
        "--optim.warmup_steps=0",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.eval_batches=1",
        "--train.batch_size=4",
        "--train.device=cpu",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
    ]
    assert main(args) == 0

    # the run's model as trained: the base (frozen) and its adapters, not merged
    cfg = config_from_dict(load_toml(run / "config.toml"))
    meta = read_meta(run / "tokenizer")
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu", meta["tokenizer"]["eot_id"])
    apply_configured(model, cfg.finetune)
    path = checkpoint.latest_valid(run / "ckpt", model_only=True)
    model.load_state_dict(frozen_base(cfg, model, path), strict=False)  # the checkpoint holds what trained
    checkpoint.load_model(path, model)
    adapters = {k: v for k, v in model.state_dict().items() if is_lora_name(k)}
    assert adapters and all(v.abs().sum() > 0 for k, v in adapters.items() if k.endswith("lora_B"))  # trained

    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, n_tok + 6, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.eval()(ids)[..., : n_tok + 6]
        exported = theirs(ids).logits[..., : n_tok + 6]
    torch.testing.assert_close(exported, ours, rtol=0, atol=1e-5)

    # the same run as peft's adapter format over its frozen base (the embedding and head trained: the chat
    # tokens were added, finetune.lora_embeddings=auto): PeftModel gives the unmerged model's logits
    peft = pytest.importorskip("peft", reason="peft (the hf extra) reads --format peft")
    assert main(["export", str(run), "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    adapter_cfg = json.loads((tmp_path / "peft" / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["modules_to_save"] == ["embed_tokens", "lm_head"]
    base_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base")
    with torch.no_grad():
        plain = base_model(ids).logits[..., : n_tok + 6]
        served = peft.PeftModel.from_pretrained(base_model, tmp_path / "peft" / "adapter").eval()(ids).logits
    torch.testing.assert_close(served[..., : n_tok + 6], ours, rtol=0, atol=1e-5)
    assert (plain - ours).abs().max() > 1e-3  # the base alone is another model: the adapters carry the tuning

    # transformers' chat template renders a conversation as loom's chat data did
    from loom.data.chat import ChatTemplate
    from loom.data.tokenizers import load_tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "reverse: apple river"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ours_ids = ChatTemplate(load_tokenizer(run / "tokenizer", meta)).prompt(msgs)
    assert tok(text, add_special_tokens=False).input_ids == ours_ids


def test_the_tokenizers_own_chat_template_trains_chats_and_exports(tmp_path, capsys):
    """--chat-template tokenizer (a Llama-3-style Jinja template of the HF tokenizer folder, nothing added to
    the vocabulary): LoRA SFT of the HF Llama, `loom chat` answers through that template, and the export's
    apply_chat_template gives the ids loom prompts with."""
    from test_chat_data import LLAMA3_JINJA, LLAMA3_SPECIALS, hf_tokenizer_folder

    from loom.data.chat import chat_template_of
    from loom.data.loader import read_meta
    from loom.data.tokenizers import load_tokenizer

    hf_dir = hf_tokenizer_folder(
        tmp_path / "llama",
        LLAMA3_SPECIALS,
        LLAMA3_JINJA,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    with open(tmp_path / "conv.jsonl", "w", encoding="utf-8") as f:
        for w in (["hi", "hey"], ["how", "are", "you"], ["fine", "thanks"]) * 8:
            msgs = [
                {"role": "user", "content": " ".join(w)},
                {"role": "assistant", "content": " ".join(w[::-1])},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    chat = tmp_path / "chat"
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(tmp_path / "conv.jsonl"),
                "--out",
                str(chat),
                "--tokenizer",
                str(hf_dir),
                "--chat-template",
                "tokenizer",
                "--block-size",
                "64",
            ]
        )
        == 0
    )
    assert read_meta(chat)["chat"]["template"] == "tokenizer"
    args = [
        "train",
        f"--data.path={chat}",
        f"--model.init_from=hf:{hf_dir}",
        f"--run.dir={tmp_path / 'runs'}",
        "--run.name=own",
        "--model.block_size=64",
        "--finetune.lora_rank=2",
        "--train.steps=2",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.eval_batches=1",
        "--train.batch_size=4",
        "--train.device=cpu",
        "--data.doc_mask=true",
    ]
    assert main(args) == 0
    run = tmp_path / "runs" / "own"
    capsys.readouterr()
    assert main(["chat", str(run), "--prompt", "how are you", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "how are you"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = read_meta(run / "tokenizer")
    ours = chat_template_of(load_tokenizer(run / "tokenizer", meta), meta).prompt(msgs)
    assert tok(text, add_special_tokens=False).input_ids == ours


def test_an_hf_gpt2_without_room_grows_its_vocabulary_for_the_chat_tokens(tmp_path, capsys):
    """GPT-2's vocab_size is its tokenizer's (no reserved rows): loom's 6 chat tokens get new rows, each the
    mean of the imported rows, every imported id keeping its own; the run trains, and its export (vocab_size
    + 6) gives loom's logits in transformers."""
    from loom.config import load_config
    from loom.model.hf import apply_init_from
    from loom.model.registry import spec_of
    from loom.runs import load_run, pretrained_state

    tok = _byte_bpe("reverse: apple river stone cloud")
    n = tok.get_vocab_size()
    hf_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=n, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(hf_dir)
    tok.save(str(hf_dir / "tokenizer.json"))
    _write_reversals(tmp_path / "conv.jsonl", (["apple", "river"], ["stone", "cloud"]) * 8)
    chat = tmp_path / "chat"
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(tmp_path / "conv.jsonl"),
                "--out",
                str(chat),
                "--tokenizer",
                str(hf_dir / "tokenizer.json"),
                "--block-size",
                "64",
            ]
        )
        == 0
    )

    flags = [f"--data.path={chat}", f"--model.init_from=hf:{hf_dir}", "--model.block_size=64"]
    loom_cfg = load_config(None, flags)
    apply_init_from(loom_cfg)
    assert loom_cfg.model.vocab_size == n + 6
    model = spec_of(loom_cfg).build_model(loom_cfg, n + 6, "cpu")
    wte = pretrained_state(loom_cfg, model)["wte.weight"]
    theirs = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).transformer.wte.weight.detach()
    assert torch.equal(wte[:n], theirs)
    torch.testing.assert_close(wte[n : n + 6], theirs.mean(0).expand(6, -1))

    args = [
        *flags,
        f"--run.dir={tmp_path / 'runs'}",
        "--run.name=sft",
        "--train.steps=2",
        "--train.batch_size=4",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--train.device=cpu",
    ]
    assert main(["sft", *args]) == 0
    assert main(["sft", *args, "--train.steps=3", "--train.resume=auto"]) == 0  # the same growth again
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "runs" / "sft"), "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.vocab_size == n + 6
    _, ours, *_ = load_run(tmp_path / "runs" / "sft", torch.device("cpu"))
    ids = torch.randint(0, n + 6, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, ours.eval()(ids)[..., : n + 6], rtol=0, atol=1e-5)
