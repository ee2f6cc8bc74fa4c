"""`loom bench generate` on a tiny model: its records hold every figure it promises, loom's greedy tokens equal
transformers' on loom's export of the same weights (side by side in one process), and with a run and clients
it measures loom serve with and without continuous batching. Timings are not asserted (a shared CPU)."""

import json

from loom.cli import main

TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=64",
    "--model.vocab_size=96",
]


def test_speed_records_beside_transformers(tmp_path):
    out = tmp_path / "gen.json"
    argv = ["bench", "generate", "--batch", "1,3", "--prompt-len", "8", "--new-tokens", "6", "--rounds", "1"]
    assert main([*argv, "--device", "cpu", "--json", str(out), *TINY]) == 0
    records = json.loads(out.read_text())
    assert [r["batch"] for r in records] == [1, 3]
    for r in records:
        assert r["same_tokens"] is True  # the same model on both sides: greedy tokens agree
        for side in ("loom", "hf"):
            assert all(r[side][k] > 0 for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s"))
        assert r["decode_vs_hf"] > 0 and "bandwidth" not in r  # bandwidth: CUDA only


def test_load_against_loom_serve(tmp_path, sft):
    out = tmp_path / "load.json"
    run = sft / "runs" / "base"
    argv = [
        "bench",
        "generate",
        str(run),
        "--batch",
        "2",
        "--prompt-len",
        "6",
        "--new-tokens",
        "5",
        "--no-hf",
    ]
    assert main([*argv, "--rounds", "1", "--clients", "3", "--requests", "2", "--json", str(out)]) == 0
    load = json.loads(out.read_text())[-1]
    assert load["kind"] == "load" and load["batched"]["max_seqs"] == 3 and load["serial"]["max_seqs"] == 1
    for mode in ("batched", "serial"):
        assert load[mode]["p50_s"] <= load[mode]["p99_s"] and load[mode]["tok_s"] > 0
    assert load["batching_speedup"] > 0


def test_bad_options_are_refused_before_work(tmp_path, capsys):
    assert main(["bench", "generate", "--batch", "0", *TINY]) == 2
    assert main(["bench", "generate", "--clients", "2", *TINY]) == 2  # clients need a run's tokenizer
    assert "give RUN" in capsys.readouterr().err


def test_prefix_cache_record_with_and_without(tmp_path):
    out = tmp_path / "prefix.json"
    argv = ["bench", "generate", "--shared-prefix", "32", "--prefix-requests", "6", "--batch", "3"]
    argv += ["--prompt-len", "4", "--new-tokens", "3", "--rounds", "1", "--device", "cpu", "--json", str(out)]
    assert main([*argv, *TINY]) == 0
    (r,) = json.loads(out.read_text())
    assert r["kind"] == "prefix" and r["same_tokens"] is True
    # the shared 32 tokens (2 blocks of 16) computed once; each request's own 4 always
    assert r["off"]["prefilled_tokens"] == 6 * 36 and r["on"]["prefilled_tokens"] == 32 + 6 * 4
    for side in ("off", "on"):
        assert r[side]["ttft_p50_s"] <= r[side]["ttft_p99_s"] and r[side]["tok_s"] > 0


def test_speculation_and_int8_records_on_a_run(tmp_path, sft):
    run = str(sft / "runs" / "base")
    out = tmp_path / "spec.json"
    argv = [
        "bench",
        "generate",
        run,
        "--batch",
        "1,2",
        "--prompt-len",
        "6",
        "--new-tokens",
        "5",
        "--rounds",
        "1",
    ]
    assert main([*argv, "--speculate", "ngram", "--json", str(out)]) == 0
    for r in json.loads(out.read_text()):
        assert r["kind"] == "speculate" and r["same_tokens"] is True and r["plain"]["forwards"] == 5
        assert 0 <= r["spec"]["acceptance"] <= 1 and r["spec"]["tokens_per_verify"] >= 1
    assert main([*argv, "--quantize", "int8", "--no-hf", "--val-windows", "2", "--json", str(out)]) == 0
    (q,) = json.loads(out.read_text())
    assert q["kind"] == "quantize" and set(q["speed"]) == {"1", "2"}
    assert abs(q["val_loss"]["change"]) < 0.1 and q["speed"]["2"]["int8"]["decode_tok_s"] > 0
    assert main([*argv, "--draft", str(tmp_path)]) == 2  # not a run: refused before anything loads
