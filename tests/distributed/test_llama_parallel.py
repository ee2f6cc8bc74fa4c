"""The llama family under tensor, sequence and pipeline parallel together, with real processes (gloo): `loom
verify` of tp=2 x pp=2 (sequence parallel) against one process. It covers what the GPT-2 strategies do not:
grouped-query heads split across tp ranks (2 key/value heads for 4 query heads), QK-norm gains reduced over
heads, RMSNorm on sequence shards, a first stage without a position table (RoPE), and an untied head on the
last stage (no tied group); with Qwen's options too: q/k/v biases (Qwen 2.5) and heads wider than n_embd / n_head
(Qwen3's head_size: q and o map 64 <-> 4 x 24), sharded by heads."""

from __future__ import annotations

import json

from loomrun import loom_run


def test_verify_tp_pp_sp_llama_gqa_qk_norm(tmp_path, char_data):
    r = loom_run(
        "verify",
        "--strategies",
        "tp-pp",
        "--steps",
        "4",
        "--out",
        str(tmp_path / "v"),
        "--data",
        str(char_data),
        "--json",
        str(tmp_path / "v.json"),
        "--tol-loss",
        "1e-5",
        "--model.family=llama",
        "--model.n_kv_head=2",
        "--model.qk_norm=true",
        "--model.qkv_bias=true",
        "--model.head_size=24",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "v.json").read_text())
    assert (rec["strategy"], rec["dp"], rec["tp"], rec["pp"]) == ("tp-pp", 1, 2, 2)
    assert rec["passed"] and rec["max_abs_dloss"] <= 1e-5 and rec["max_abs_dparam"] <= 1e-5, rec
    config = (tmp_path / "v" / "tp-pp" / "config.toml").read_text()
    assert 'pos = "rope"' in config and "n_kv_head = 2" in config and "tie_embeddings = false" in config
