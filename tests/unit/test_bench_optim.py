"""`loom bench optim` and `loom bench peak` on tiny sizes: parsing, GPT shapes against loom's own
parameter count, the bandwidth arithmetic (28 bytes per fp32 parameter / step time), and the JSON records.
"""

from __future__ import annotations

import json

import pytest
import torch

from loom.bench.optim import BYTES_PER_PARAM, bandwidth_gbps, gpt_config, gpt_shapes, optim_main, parse_count
from loom.bench.peak import datasheet_flops, peak_main
from loom.errors import LoomError
from loom.model.flops import param_count


@pytest.mark.parametrize(
    "text, n",
    [
        ("124M", 124_000_000),
        ("1.5B", 1_500_000_000),
        ("1.5g", 1_500_000_000),
        ("350K", 350_000),
        ("10m", 10_000_000),
        ("5000", 5000),
        (" 2.5M ", 2_500_000),
    ],
)
def test_parse_count(text, n):
    assert parse_count(text) == n


@pytest.mark.parametrize("text", ["", "abc", "12X", "0", "1.2.3M", "-5M"])
def test_parse_count_rejects(text):
    with pytest.raises(LoomError, match="cannot parse"):
        parse_count(text)


def test_gpt_shapes():
    small = gpt_config(124_000_000)  # GPT-2 small exactly
    assert (small.n_layer, small.n_embd, small.vocab_size, small.block_size) == (12, 768, 50257, 1024)
    xl = gpt_config(parse_count("1.5B"))
    assert (xl.n_layer, xl.n_embd) == (48, 1600)
    for n in (10**6, 10**7):
        cfg = gpt_config(n)
        shapes = gpt_shapes(cfg)
        total = sum(torch.Size(s).numel() for s in shapes)
        assert total == param_count(cfg)  # the shapes are loom's GPT's, tied head counted once
        assert 0.7 * n < total < 1.3 * n
        assert (
            len(shapes) == 4 + 16 * cfg.n_layer
        )  # wte, wpe, ln_f (w, b) + per block 16 (weights and biases)


def test_bandwidth_arithmetic():
    assert BYTES_PER_PARAM == 28
    assert bandwidth_gbps(10**9, 28.0) == pytest.approx(1.0)
    assert bandwidth_gbps(124_000_000, 0.002) == pytest.approx(28 * 124e6 / 0.002 / 1e9)


def test_bench_optim_json(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "optim.json"
    argv = [
        "--params",
        "1M",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--copy-mb",
        "8",
        "--impls",
        "torch-fused,torch-loop,triton",
        "--json",
        str(out),
    ]
    assert optim_main(argv) == 0
    assert "torch-fused" in capsys.readouterr().out
    recs = {r["impl"]: r for r in json.loads(out.read_text())}
    assert list(recs) == ["torch-fused", "torch-loop", "triton"]
    assert "skipped" in recs["triton"]  # CPU without the interpreter (or no triton at all)
    for r in (recs["torch-fused"], recs["torch-loop"]):
        assert r["bench"] == "optim" and r["device"] == "cpu" and r["iters"] == 3 and r["warmup"] == 1
        assert 0.7e6 < r["n_params"] < 1.3e6 and r["n_tensors"] == 4 + 16 * r["model"]["n_layer"]
        assert r["bytes_per_step"] == 28 * r["n_params"]
        assert r["time_ms_min"] <= r["time_ms"]
        assert r["bandwidth_gbps"] == pytest.approx(r["bytes_per_step"] / (r["time_ms"] / 1e3) / 1e9)
        assert r["fraction_of_copy"] == pytest.approx(r["bandwidth_gbps"] / r["copy_bandwidth_gbps"])
        assert r["copy_bytes"] == 8 * 2**20 and r["copy_bandwidth_gbps"] > 0
    assert recs["torch-fused"]["speedup_vs_torch_fused"] == 1.0
    assert recs["torch-loop"]["speedup_vs_torch_fused"] == pytest.approx(
        recs["torch-fused"]["time_ms"] / recs["torch-loop"]["time_ms"]
    )


def test_bench_optim_triton_in_interpreter(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "optim.json"
    argv = [
        "--params",
        "100K",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--device",
        "cpu",
        "--copy-mb",
        "1",
        "--impls",
        "triton",
        "--json",
        str(out),
        "--quiet",
    ]
    assert optim_main(argv) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["launches_per_step"] == 1.0 and rec["speedup_vs_torch_fused"] is None


def test_bench_optim_errors():
    with pytest.raises(LoomError, match="unknown implementation"):
        optim_main(["--impls", "torch-fused,apex"])
    with pytest.raises(LoomError, match="cannot parse"):
        optim_main(["--params", "lots"])


def test_bench_peak_json(tmp_path, capsys):
    out = tmp_path / "peak.json"
    argv = [
        "--device",
        "cpu",
        "--dtypes",
        "fp32,bf16",
        "--sizes",
        "64,128",
        "--seconds",
        "0.05",
        "--copy-mb",
        "8",
        "--json",
        str(out),
    ]
    assert peak_main(argv) == 0
    assert "matmul" in capsys.readouterr().out
    recs = json.loads(out.read_text())
    assert [(r["what"], r.get("dtype")) for r in recs] == [
        ("matmul", "fp32"),
        ("matmul", "bf16"),
        ("copy", None),
    ]
    for r in recs[:2]:
        assert r["flops"] > 0 and r["size"] in (64, 128) and set(r["by_size"]) == {"64", "128"}
        assert r["flops"] == max(r["by_size"].values())
        assert r["datasheet_flops"] is None and r["fraction_of_datasheet"] is None  # CPU: no datasheet
    assert recs[2]["bytes"] == 8 * 2**20 and recs[2]["bandwidth_gbps"] > 0
    assert all(r["device"] == "cpu" and r["threads"] >= 1 for r in recs)


def test_bench_peak_leaves_out_sizes_too_slow_for_the_budget(monkeypatch):
    from loom.bench import peak

    monkeypatch.setattr(peak, "probe_flops", lambda device, dt: 1e6)  # 1 MFLOP/s: a very slow dtype
    rec = peak.bench_matmul(torch.device("cpu"), "fp32", [64, 128], seconds=0.01)
    assert list(rec["by_size"]) == ["64"] and "left out" in rec["note"]  # the smallest size always runs


def test_datasheet_peak_by_gpu_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert datasheet_flops(torch.device("cuda"), "bf16") == 989e12
    assert datasheet_flops(torch.device("cpu"), "bf16") is None
    with pytest.raises(LoomError, match="unknown dtype"):
        peak_main(["--device", "cpu", "--dtypes", "fp8"])
