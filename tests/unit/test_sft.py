"""Chat SFT (issue 34): packing, masked targets, the loss's normalisation, fine-tuning from a run, loom chat.

Compared against: the conversations as prepared (each packed row holds whole ones, every one once an epoch);
the chat template's masks (a target is trained on exactly when it is an assistant token or its end of turn);
the loss computed by hand (the sum of the global batch's trained targets' cross-entropies over their count,
with accumulation over micro-batches of unequal counts); each conversation run alone (a packed row with
document masks gives the same per-token losses, 1e-6 in fp32); the base run's weights (kept, new chat-token
rows their mean); and the model itself behind `loom chat --prompt` (its greedy answer).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sftkit import MODEL, _sft_args

from loom.cli import main
from loom.config import config_from_dict, load_toml
from loom.data.chat import ASSISTANT_END, ASSISTANT_START, ChatTemplate
from loom.data.loader import read_meta
from loom.data.sft import ChatLoader, Conversations
from loom.data.tokenizers import load_tokenizer


def test_packing_keeps_conversations_whole_and_visits_each_once(sft):
    convs = Conversations(sft / "chat", "train", 128)  # rows of 129 tokens: two or three conversations each
    order = np.random.default_rng(0).permutation(len(convs))
    rows = convs.pack(order)
    assert sorted(c for r in rows for c in r) == list(range(len(convs)))  # each once
    room = []
    for r in rows:
        assert sum(int(convs.lengths[c]) for c in r) <= 129  # no conversation crosses the row's end
        room.append(129 - sum(int(convs.lengths[c]) for c in r))
        ids, mask = convs.row(r)
        at = 0
        for c in r:  # the row holds each conversation's tokens and mask as prepared, one after the other
            s, n = int(convs.starts[c]), int(convs.lengths[c])
            assert np.array_equal(ids[at : at + n], convs.tokens[s : s + n])
            assert np.array_equal(mask[at : at + n], convs.mask[s : s + n])
            at += n
        assert (ids[at:] == convs.eot).all() and not mask[at:].any()  # padding: end-of-text, never trained
    assert max(len(r) for r in rows) >= 2
    # a new row is opened only for a conversation that fits in no open row: longer than any earlier row's room
    for j, r in enumerate(rows):
        assert all(int(convs.lengths[r[0]]) > room[i] for i in range(j)), j


def test_targets_are_the_assistants_tokens_only(sft):
    meta = read_meta(sft / "chat")
    tok = load_tokenizer(sft / "chat", meta)
    t = ChatTemplate(tok)
    loader = ChatLoader(sft / "chat", 8, 64, seed=3)
    x, y = loader.next_batch()
    assert loader.valid_targets == int((y != -1).sum()) > 0
    user_side = {t.eot_id, *(i for s, i in t.ids.items() if s not in (ASSISTANT_END,))}
    assert not any(int(v) in user_side for v in y[y != -1])  # no user, system or start token is a target
    # every target after an assistant's start is trained up to and including its end of turn, and nothing else
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        inside = False
        for xi, yi in zip(row_x, row_y, strict=True):
            if xi == t.ids[ASSISTANT_START]:
                inside = True
            assert (yi != -1) == inside, (xi, yi)
            if yi == t.end_id:
                inside = False


def _batch_loss_by_hand(sft, run: str) -> float:
    """Step 1's loss of `run` computed here: its initial weights (the base grown by the chat tokens), the same
    global batch, the sum of the trained targets' cross-entropies over their count."""
    from loom.model.registry import spec_of
    from loom.runs import run_init_state

    cfg = config_from_dict(load_toml(sft / "runs" / run / "config.toml"))
    meta = read_meta(sft / "chat")
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu", meta["tokenizer"]["eot_id"])
    model.load_state_dict(run_init_state(cfg, model))
    x, y = ChatLoader(sft / "chat", cfg.train.batch_size, cfg.model.block_size, cfg.run.seed).next_batch()
    with torch.no_grad():
        logits = model(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
    return float(ce / (y != -1).sum())


def test_sft_loss_is_the_global_batch_mean_over_trained_targets(sft):
    """4 micro-batches of 2 rows (their trained targets differ): the step's loss is still the global mean."""
    args = _sft_args(
        sft, "normalised", "--train.steps=1", "--train.batch_size=8", "--train.micro_batch_size=2"
    )
    assert main(args) == 0
    rec = next(
        json.loads(line) for line in open(sft / "runs" / "normalised" / "metrics.jsonl") if '"loss"' in line
    )
    assert rec["loss"] == pytest.approx(_batch_loss_by_hand(sft, "normalised"), rel=1e-5)


def test_a_packed_row_with_document_masks_equals_each_conversation_alone(sft):
    from loom.model.gpt.gpt import GPT, GPTConfig

    meta = read_meta(sft / "chat")
    eot = meta["tokenizer"]["eot_id"]
    convs = Conversations(sft / "chat", "train", 128)
    row = next(r for r in convs.pack(np.arange(len(convs))) if len(r) >= 3)
    ids, _ = convs.row(row)
    torch.manual_seed(0)
    cfg = GPTConfig(meta["vocab_size"], 2, 2, 32, 128, doc_mask=True, eot_id=eot, doc_positions="restart")
    model = GPT(cfg).eval()
    packed = torch.from_numpy(ids)[None]
    with torch.no_grad():
        whole = F.log_softmax(model(packed[:, :-1]).float(), -1)[0]
        at = 0
        for c in row:
            n = int(convs.lengths[c])
            alone = torch.from_numpy(ids[at : at + n])[None]
            own = F.log_softmax(model(alone).float(), -1)[0]
            torch.testing.assert_close(whole[at : at + n - 1], own[: n - 1], rtol=0, atol=1e-6)
            at += n


def test_init_from_run_grows_the_vocabulary_with_mean_rows(sft):
    from loom.model.registry import spec_of
    from loom.runs import run_init_state

    assert main(_sft_args(sft, "grown", "--train.steps=1")) == 0
    cfg = config_from_dict(load_toml(sft / "runs" / "grown" / "config.toml"))
    base_meta, meta = read_meta(sft / "runs" / "base" / "tokenizer"), read_meta(sft / "chat")
    old, new = base_meta["vocab_size"], meta["vocab_size"]
    assert new == old + 6 and meta["chat"]["base_vocab_size"] == old
    model = spec_of(cfg).build_model(cfg, new, "cpu", meta["tokenizer"]["eot_id"])
    state = run_init_state(cfg, model)
    from loom.runs import load_run

    base_wte = load_run(sft / "runs" / "base", torch.device("cpu"))[1].state_dict()["wte.weight"]
    wte = state["wte.weight"]
    assert torch.equal(wte[:old], base_wte[:old])  # every id the base learned keeps its row
    torch.testing.assert_close(wte[old:new], base_wte[:old].mean(0).expand(new - old, -1))


def test_chat_answers_and_refuses_a_base_model(sft, capsys):
    assert (
        main(["sft", *_sft_args(sft, "chat-run", "--train.steps=2")[1:]]) == 0
    )  # loom sft: loom train, checked
    capsys.readouterr()
    assert (
        main(
            [
                "chat",
                str(sft / "runs" / "chat-run"),
                "--prompt",
                "reverse: apple stone",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    answer = capsys.readouterr().out
    assert answer.endswith("\n") and "<|" not in answer  # the answer only, no chat token
    # the run's end-of-run sample was a reply to the first validation prompt, beside the data's answer
    sample = (sft / "runs" / "chat-run" / "samples.txt").read_text()
    prompt, reply, expected = sample.splitlines()[1:4]
    assert prompt.startswith("prompt:   <|") and prompt.endswith("<|user_end|><|assistant_start|>")
    assert reply.startswith("reply:    ") and "<|assistant_end|>" not in reply
    assert expected.startswith("expected: ") and "<|" not in expected
    words = prompt.split("reverse: ")[1].split("<|")[0].split()
    assert expected.split()[1:] == words[::-1]  # the conversations ask for the words reversed
    assert main(["chat", str(sft / "runs" / "base"), "--prompt", "hi"]) == 2
    assert "base model" in capsys.readouterr().err


def test_repl_resets_and_quits(sft):
    import io

    from loom.chat import ChatSession, chat_template, repl
    from loom.runs import load_run

    run = sft / "runs" / "chat-run"
    if not run.is_dir():
        assert main(_sft_args(sft, "chat-run", "--train.steps=2")) == 0
    cfg, model, tok, meta, _ = load_run(run, torch.device("cpu"))
    session = ChatSession(model, chat_template(tok, meta, run), tok, torch.device("cpu"), system="be clear")
    session.sampling.max_new_tokens = 3
    lines = iter(["reverse: apple river", "/reset", "zzz?", "again", "/quit"])
    out = io.StringIO()
    repl(session, read=lambda _: next(lines), write=out)
    assert "(new conversation)" in out.getvalue()
    assert "(not sent: character 'z' is not in the character vocabulary)" in out.getvalue()
    # after /reset the conversation holds the system message, the last turn and its answer only
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[1]["content"] == "again"


def test_loom_sft_refuses_plain_data_and_a_missing_base(sft, capsys):
    """`loom sft` is `loom train` that insists on conversations and a model to start from (loom train would
    pretrain on plain shards, or fine-tune from random weights), one error each before any work."""
    args = _sft_args(sft, "refused", "--train.steps=1")[1:]
    capsys.readouterr()
    plain = [a if not a.startswith("--data.path=") else f"--data.path={sft / 'text'}" for a in args]
    assert main(["sft", *plain]) == 2
    assert "holds plain token shards" in capsys.readouterr().err
    assert main(["sft", *[a for a in args if not a.startswith("--model.init_from=")]]) == 2
    assert "model.init_from is not set" in capsys.readouterr().err
    assert main(["sft", *[a for a in args if not a.startswith("--data.path=")]]) == 2
    assert "data.path is not set" in capsys.readouterr().err
    assert not (sft / "runs" / "refused").exists()


def test_chat_data_of_one_conversation_is_refused_by_name(sft, tmp_path, capsys):
    """One conversation is all train (prepare keeps val empty): the run names the empty split, not a
    damaged file."""
    msgs = [
        {"role": "user", "content": "reverse: apple river"},
        {"role": "assistant", "content": "river apple"},
    ]
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(tmp_path / "one.jsonl"),
                "--out",
                str(tmp_path / "one"),
                "--tokenizer",
                str(sft / "runs" / "base"),
                "--block-size",
                "64",
            ]
        )
        == 0
    )
    args = _sft_args(sft, "one", "--train.steps=1")
    args[1] = f"--data.path={tmp_path / 'one'}"
    capsys.readouterr()
    assert main(args) == 2
    assert "has no val conversations (1 in all)" in capsys.readouterr().err


def test_sft_refuses_data_of_another_tokenizer(sft, tmp_path, capsys):
    """Before any process starts: the data's ids must mean to the model what they meant to its tokenizer."""
    # chat data prepared with another tokenizer (its own characters) than the run's
    other = tmp_path / "other.jsonl"
    msgs = [{"role": "user", "content": "zzz"}, {"role": "assistant", "content": "qqq"}]
    other.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"messages": msgs}) + "\n")
    assert (
        main(
            [
                "data",
                "prepare",
                "--chat",
                "--input",
                str(other),
                "--out",
                str(tmp_path / "chat"),
                "--tokenizer",
                "char",
                "--block-size",
                "64",
            ]
        )
        == 0
    )
    args = _sft_args(sft, "other", "--train.steps=1")
    args[1] = f"--data.path={tmp_path / 'chat'}"
    capsys.readouterr()
    assert main(args) == 2
    assert "not tokenized with the tokenizer of the run" in capsys.readouterr().err


def test_lora_sft_trains_the_new_tokens_rows_and_freezes_the_blocks(sft):
    """With chat tokens added (finetune.lora_embeddings=auto) the embedding and head train beside the
    adapters: the new rows start alike (the mean) and must tell the chat tokens apart; the blocks stay frozen."""
    from loom.model.lora import is_lora_name
    from loom.runs import load_run

    assert main(_sft_args(sft, "lora", "--train.steps=2", "--finetune.lora_rank=2", "--optim.lr=1e-2")) == 0
    base = load_run(sft / "runs" / "base", torch.device("cpu"))[1].state_dict()
    cfg, model, *_ = load_run(sft / "runs" / "lora", torch.device("cpu"))  # adapters merged
    tuned = model.state_dict()
    assert not any(is_lora_name(k) for k in tuned)
    assert (
        tuned["wte.weight"].shape == base["wte.weight"].shape
    )  # the padded rows had room for the chat tokens
    assert not torch.equal(tuned["wte.weight"], base["wte.weight"])  # the embedding trained
    assert torch.equal(tuned["blocks.0.mlp.up_proj.weight"], base["blocks.0.mlp.up_proj.weight"])  # frozen
    assert not torch.equal(
        tuned["blocks.0.attn.q_proj.weight"], base["blocks.0.attn.q_proj.weight"]
    )  # merged


def test_frozen_new_token_rows_are_warned_about(sft, capsys):
    """Issue 42 item 2: finetune.lora_embeddings=false on chat data left every chat token one identical frozen
    row, in silence. It is warned about (not refused: adapter-only checkpoints and shared-base serving want
    it), naming how many tokens are new and the remedy; auto says nothing (it trains them)."""
    meta = read_meta(sft / "chat")
    new = meta["vocab_size"] - meta["chat"]["base_vocab_size"]
    assert new > 0
    frozen = _sft_args(sft, "frozen-rows", "--train.steps=1", "--finetune.lora_rank=2")
    assert main([*frozen, "--finetune.lora_embeddings=false"]) == 0
    out = capsys.readouterr().out
    assert f"finetune.lora_embeddings=false, but the data adds {new} token(s)" in out
    assert "Set finetune.lora_embeddings=auto (or true)" in out
    assert main([*frozen, "--finetune.lora_embeddings=auto", "--force"]) == 0
    assert "lora_embeddings=false" not in capsys.readouterr().out


def test_a_lora_runs_checkpoint_holds_what_it_trains_and_resumes(sft, capsys):
    """Adapter-only checkpoints: the frozen base is left out (it is model.init_from's), so they are small;
    resuming, loading (eval, chat, export) and the refusal to consolidate all rebuild or name the base."""
    from loom import checkpoint
    from loom.model.lora import is_lora_name
    from loom.parallel.dcp_state import saved_keys

    args = _sft_args(sft, "lora-ckpt", "--finetune.lora_rank=2", "--finetune.lora_embeddings=false")
    assert main([*args, "--train.steps=2"]) == 0
    run = sft / "runs" / "lora-ckpt"
    path = checkpoint.latest_valid(run / "ckpt")
    keys = set(saved_keys(path / "model"))
    assert keys and all(is_lora_name(k) for k in keys), sorted(keys)[:5]  # the adapters only
    base = checkpoint.latest_valid(sft / "runs" / "base" / "ckpt")
    size = sum(f.stat().st_size for f in (path / "model").iterdir())
    assert size < sum(f.stat().st_size for f in (base / "model").iterdir()) / 5
    assert main([*args, "--train.steps=3", "--train.resume=auto"]) == 0  # the base from init_from, then this
    assert checkpoint.latest_valid(run / "ckpt").name == "step_000003"
    capsys.readouterr()
    assert main(["ckpt", "consolidate", str(run), "--out", str(sft / "consolidated")]) == 2
    assert "LoRA run's checkpoint" in capsys.readouterr().err


def test_lora_from_a_run_under_pp_cp_zero1_and_sequence_parallel_equals_one_process(sft, tmp_path):
    """model.init_from=run:DIR checked its weights against this rank's pipeline stage, which holds only its
    blocks, and LoRA's FLOPs read the head a first stage does not hold: both refused to start under pp; ZeRO-1
    took its optimizer's second parameter group for granted (a LoRA run has one); torch's SequenceParallel
    made the frozen norms' gains trainable again (tp-sp: grad norm 15x one process's). `loom verify` (2
    processes each) against one process."""
    from loomrun import verify_records

    base = f"--model.init_from=run:{sft / 'runs' / 'base'}"
    recs = verify_records(
        tmp_path,
        sft / "chat",
        "pp-1f1b,cp-ulysses,zero1,tp-sp",
        "--nproc",
        "2",
        base,
        "--finetune.lora_rank=2",
        *MODEL,
    )
    assert [(r["pp"], r["cp"], r["tp"]) for r in recs] == [(2, 1, 1), (1, 2, 1), (1, 1, 1), (1, 1, 2)]


def test_a_lora_run_under_muon_resumes(sft):
    """Under optim.name=muon a LoRA run has no hidden matrix to train (the adapters are AdamW's): the empty
    Muon group is left out, else its checkpoint could not be loaded (an IndexError in torch's DCP)."""
    from loom import checkpoint

    args = _sft_args(
        sft, "muon-lora", "--finetune.lora_rank=2", "--finetune.lora_embeddings=false", "--optim.name=muon"
    )
    assert main([*args, "--train.steps=2"]) == 0
    assert main([*args, "--train.steps=3", "--train.resume=auto"]) == 0
    assert checkpoint.latest_valid(sft / "runs" / "muon-lora" / "ckpt").name == "step_000003"


def test_peft_export_refuses_what_it_cannot_write(sft, tmp_path, capsys):
    """--format peft: a run without adapters, and GPT-2's adapters (its q, k, v are one Conv1D in
    transformers), are refused before anything is written; both export merged (--format hf)."""
    assert main(_sft_args(sft, "gpt2-lora", "--train.steps=1", "--finetune.lora_rank=2")) == 0
    capsys.readouterr()
    for run, why in (("base", "has no LoRA adapters"), ("gpt2-lora", "model.family=gpt2")):
        assert (
            main(["export", str(sft / "runs" / run), "--format", "peft", "--out", str(tmp_path / run)]) == 2
        )
        err = capsys.readouterr().err
        assert why in err and "--format hf" in err
        assert not (tmp_path / run / "base").exists()


def test_init_optimizer_continues_the_base_runs_optimizer_state(sft, capsys):
    """finetune.init_optimizer: AdamW's moments and step count come from the base run (3 steps), so one SFT
    step later a matrix's state has taken 4 steps; refused without run:DIR or with LoRA."""
    from loom import checkpoint
    from loom.parallel.dcp_state import read_whole

    assert main(_sft_args(sft, "opt", "--train.steps=1", "--finetune.init_optimizer=true")) == 0
    state = read_whole(checkpoint.latest_valid(sft / "runs" / "opt" / "ckpt") / "optim")
    key = "state.blocks.0.attn.q_proj.weight.step"
    assert float(state[key]) == 4.0, {k: v for k, v in state.items() if k.endswith(".step")}
    capsys.readouterr()
    assert (
        main(
            _sft_args(
                sft, "opt-lora", "--train.steps=1", "--finetune.init_optimizer=true", "--finetune.lora_rank=2"
            )
        )
        == 2
    )
    assert "finetune.init_optimizer=true takes the optimizer state" in capsys.readouterr().err


def test_a_run_without_its_tokenizer_is_named_as_such(sft, tmp_path, capsys):
    """Issue 42 item 10: a run directory without tokenizer/ was reported as "data.path '<run>/tokenizer' is not
    a directory" (eval, chat, export, fine-tuning from it). Now the run's tokenizer folder is named, with where
    its copy comes from (run.json's data set)."""
    import shutil

    run = tmp_path / "no-tok"
    shutil.copytree(sft / "runs" / "base", run, ignore=shutil.ignore_patterns("tokenizer"))
    data = json.loads((run / "run.json").read_text())["data_dir"]
    commands = [
        ["eval", str(run), "--device", "cpu"],
        ["chat", str(run), "--prompt", "hi", "--device", "cpu"],
        [*_sft_args(sft, "from-no-tok", "--train.steps=1"), f"--model.init_from=run:{run}"],
        [
            "data",
            "prepare",
            "--chat",
            "--input",
            str(sft / "conv.jsonl"),
            "--out",
            str(tmp_path / "c"),
            "--tokenizer",
            str(run),
            "--block-size",
            "64",
        ],
    ]
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"run '{run}' has no tokenizer: '{run / 'tokenizer'}' is missing" in err, err
        assert f"copy the tokenizer of its data set '{data}' back" in err and "data.path" not in err
    assert main(["ckpt", "consolidate", str(run), "--out", str(tmp_path / "whole")]) == 0
    assert "config.toml (the run has no tokenizer/)" in capsys.readouterr().out  # it claimed tokenizer/


def test_a_lora_run_that_died_before_its_first_checkpoint_starts_again(sft, capsys):
    """Issue 42 item 8: train.resume=auto (and an elastic restart, which behaves as it) starts a pretraining run
    that died before its first checkpoint again, its folder and metrics.jsonl replaced; a LoRA/SFT run was
    compared with its config.toml before model.init_from=run:DIR's model keys were applied, never matched, and
    was refused ("a different config"), so the only ways on appended to or kept the dead attempt's records. Now
    it starts again like any run, and metrics.jsonl holds each step once."""
    import shutil

    from loom.metrics import read_jsonl

    args = _sft_args(sft, "lora-auto", "--train.steps=2", "--train.log_every=1", "--finetune.lora_rank=2")
    args.append("--train.resume=auto")
    assert main(args) == 0
    run = sft / "runs" / "lora-auto"
    shutil.rmtree(run / "ckpt")  # as a run killed before its first checkpoint leaves it
    capsys.readouterr()
    assert main(args) == 0
    assert f"{run} has no valid checkpoint: starting it again" in capsys.readouterr().out
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl", superseded=True) if "loss" in r]
    assert steps == [1, 2]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-a-row"])
def test_explain_rows_command_prints_the_sft_batch(sft, pack, capsys):
    """A bad step's record under SFT (ChatLoader.explain_rows): the batch's global rows of the packed epochs
    and the `loom data inspect --rows` command; what it prints is the batch the loader gave, row for row."""
    import shlex

    chat = ChatLoader(sft / "chat", 4, 64, 1337, pack=pack)
    for _ in range(5):  # past the first epoch when one conversation a row
        chat.next_batch()
    state = chat.state_dict()
    rec = chat.explain_rows(state, 4)
    first = state["cursor"]
    assert rec["rows"] == [first, first + 3] and ("--no-pack" in rec["inspect"]) == (not pack)
    assert main(shlex.split(rec["inspect"])[1:] + ["--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["row"] for r in printed] == list(range(first, first + 4))
    assert [r["tokens"] for r in printed] == chat.global_rows(first, 4)[0].tolist()
