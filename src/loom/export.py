"""`loom export`'s writers for other tools: a transformers directory (export_hf_dir) and, for a LoRA run,
peft's adapter format beside its base model (export_peft).

`--format peft`: OUT/base is the frozen base as a transformers directory: what the run started from (model.init_from's weights,
the embedding grown by the chat tokens, each new row the mean row), with the run's tokenizer and chat
template. OUT/adapter holds peft's adapter_config.json and adapter_model.safetensors: every adapter by
transformers' module names (lora_A (r, in), lora_B (out, r), scaling lora_alpha / r as loom's), and the
embedding and head when the run trained them (finetune.lora_embeddings: peft's modules_to_save).
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(OUT/base), OUT/adapter)` is the run's model,
and so is any server that loads LoRA adapters over one base (many adapters, one base in memory);
`loom export --format hf` writes the same model with the adapters merged.

The llama family only: GPT-2's transformers layout fuses q, k and v into one Conv1D (c_attn) that loom's
three adapters do not map onto by name, and a MoE's experts take no adapters. A tied embedding the run
trained would have to be saved twice by peft (embed_tokens and lm_head): refused too; both export merged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loom.errors import LoomError

_MERGED = "export it merged instead: loom export RUN --format hf"


def export_hf_dir(cfg, model, tok, meta: dict, out: Path, force: bool) -> list[str]:
    """The model as a transformers directory (its family's mapping) with its tokenizer and, for a chat model,
    its chat template in tokenizer_config.json; returns the notes for the user."""
    from loom.model.registry import spec_of

    spec = spec_of(cfg)
    if spec.hf is None:
        raise LoomError(
            f"the model family '{spec.name}' has no transformers mapping",
            hint="export it with --format safetensors",
        )
    # transformers' GPT-2 and Llama have no μP multipliers: the export would compute otherwise
    if cfg.model.mup:
        raise LoomError(
            "model.mup: transformers' models have no μP output and attention multipliers, so the exported "
            "model would not compute what this run's does",
            hint="export it with --format safetensors (loom reads it back with its config)",
        )
    notes = _without_doc_mask(model, cfg.data.doc_mask) + spec.hf.export_hf(model, out, tok, force)
    if isinstance(meta.get("chat"), dict) and tok is not None:  # a chat model: its template goes along
        from loom.data.chat import chat_template_of
        from loom.model.hf_io import add_chat_template

        template = chat_template_of(tok, meta)
        add_chat_template(out, template.jinja(), list(template.ids), list(template.stop_ids))
        notes.append("chat: the template is tokenizer_config.json's chat_template (apply_chat_template)")
    return notes


def _without_doc_mask(model, doc_mask: bool) -> list[str]:
    """Document masking (data.doc_mask) shapes training on packed windows; a model exported for inference
    reads one document at a time, where attention without the mask is the same: the exported config drops it."""
    import dataclasses

    if not doc_mask:  # data.doc_mask of the run (only GPT-built families have the option)
        return []
    model.cfg = dataclasses.replace(model.cfg, doc_mask=False, eot_id=-1, doc_positions="continue")
    return [
        "data.doc_mask: transformers attends over the whole sequence, which equals loom's on one document "
        "(a chat prompt, a single text); a sequence of several documents would attend across them"
    ]


def export_peft(
    run_dir: str | Path, out: Path, ckpt: str | Path | None = None, force: bool = False
) -> list[str]:
    """Write OUT/base and OUT/adapter for the LoRA run `run_dir` (module docstring); returns notes. Both are
    written beside OUT and renamed into place when whole: a full disk leaves no export that looks complete."""
    from loom.model.lora import is_lora_name, lora_modules
    from loom.model.registry import spec_of
    from loom.outputs import staged_output, write_marker
    from loom.runs import frozen_base, load_run
    from loom.train.finetune import lora_embeddings

    cfg, model, tok, meta, path = load_run(run_dir, torch.device("cpu"), ckpt, merge=False)
    f = cfg.finetune
    if not f.lora_rank:
        raise LoomError(f"run '{run_dir}' has no LoRA adapters (finetune.lora_rank=0)", hint=_MERGED)
    if spec_of(cfg).peft is None:
        raise LoomError(
            f"--format peft writes adapters with transformers' Llama module names, which model.family="
            f"{cfg.model.family} does not have (a family's ModelSpec.peft: llama's)",
            hint=_MERGED,
        )
    trained_ends = lora_embeddings(cfg, meta)
    if trained_ends and model.cfg.tie_embeddings:
        raise LoomError(
            "this LoRA run trained a tied embedding and head, which peft would save apart", hint=_MERGED
        )

    eot = model.cfg.eot_id if model.cfg.doc_mask else None
    base = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu", eot)
    start = frozen_base(
        cfg, model, path
    )  # the weights the run started from (LoRA checkpoints leave them out)
    if start is None:  # a checkpoint that holds every weight: the frozen ones are the base's
        start = {k: v for k, v in model.state_dict().items() if not is_lora_name(k)}
    base.load_state_dict(start)
    with staged_output(out, "export", force) as tmp:
        tmp.mkdir()
        write_marker(tmp, "export")  # OUT as a whole is loom's export, which --force may replace
        notes = export_hf_dir(cfg, base, tok, meta, tmp / "base", False)
        _write_adapter(model, cfg, tmp / "adapter", out / "base", trained_ends)
    what = f"{len(lora_modules(model))} adapted linears" + (
        ", the embedding and head" if trained_ends else ""
    )
    return notes + [
        f"wrote {out / 'base'} (the frozen base) and {out / 'adapter'} (peft: {what}) from {path}: "
        "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)"
    ]


def _write_adapter(model, cfg, adapter: Path, base_dir: Path, trained_ends: bool) -> None:
    """peft's adapter_config.json and adapter_model.safetensors for the LoRA model `model` into `adapter`;
    `base_dir`: where the base will be once written (adapter_config's base_model_name_or_path)."""
    from safetensors.torch import save_file

    from loom.model.hf_io import _prepare_out
    from loom.model.lora import lora_state_dict
    from loom.model.registry import spec_of

    f = cfg.finetune
    V, names = model.cfg.vocab_size, spec_of(cfg).peft(model.cfg.n_layer)
    tensors: dict[str, torch.Tensor] = {}
    targets = []
    for key, t in lora_state_dict(model).items():  # blocks.0.attn.q_proj.lora_A -> ...q_proj.lora_A.weight
        linear, which = key.rsplit(".", 1)
        theirs = names[linear]
        targets.append(theirs)
        t = t.detach().float()
        tensors[f"base_model.model.{theirs}.{which}.weight"] = (
            t[:V] if linear == "lm_head" and which == "lora_B" else t
        )
    saved = None
    if trained_ends:
        saved = ["embed_tokens", "lm_head"]
        tensors["base_model.model.model.embed_tokens.weight"] = model.wte.weight.detach().float()[:V]
        tensors["base_model.model.lm_head.weight"] = model.lm_head.weight.detach().float()[:V]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_dir.resolve()),
        "r": f.lora_rank,
        "lora_alpha": f.lora_alpha,
        "lora_dropout": f.lora_dropout,
        "target_modules": sorted(set(targets)),
        "modules_to_save": saved,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    _prepare_out(adapter, False)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
