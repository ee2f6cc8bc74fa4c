"""Every table loom prints (loom.log.print_table): whole in a file or a pipe, folded in a narrow terminal.

Compared against the values each table was handed: every one must appear as it was formatted, and no cell may
end in rich's '…'. Before print_table, a console that is not a terminal was capped at 80 columns and
`loom bench train` cut every number, `loom verify` its strategy names and results."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from rich.table import Table

from loom import log


@pytest.fixture
def piped(monkeypatch, capsys):
    """The console as loom makes it, its stdout a pipe (pytest's capture), at the default 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setitem(log._state, "console", None)

    def out() -> str:
        text = capsys.readouterr().out
        assert "…" not in text, text
        return text

    return out


def _bench_train_record(mode: str) -> dict:
    return {
        "mode": mode,
        "tokens_per_s": 1234567.0,
        "speed_vs_first": 1.2345,
        "tokens_per_s_per_device": 617283.5,
        "mfu": 0.4321,
        "ms_per_step": 12345.6,
        "time_vs_none": 0.876,
        "activation_bytes": 123456789012,
        "activations_vs_none": 0.25,
        "peak_mem_bytes": 98765432109,
        "compile_s": 123.4,
        "comm_exposed_share": 0.37,
        "params": 124_000_000,
        "tokens_per_step": 524_288,
        "dtype": "bf16",
        "device": "cpu",
        "threads": 2,
        "synthetic": True,
        "steps": 5,
        "rounds": 2,
        "peak_mem_kind": "RSS",
    }


def test_bench_train_table_whole_in_a_pipe(piped):
    from loom.bench.train import print_table

    recs = [_bench_train_record("activation_checkpointing=selective"), _bench_train_record("none")]
    print_table(recs, "loom bench train: modes")
    out = piped()
    expected = (
        "activation_checkpointing=selective 1,234,567 1.23x 617,284 43.2% 12345.6 0.88x 0.25x 123.4s 37%"
    )
    for v in [*expected.split(), "117737.6 MiB", "94190 MiB"]:
        assert v in out, (v, out)


def test_verify_table_whole_in_a_pipe(piped):
    from loom.verify import _table

    rec = {
        "strategy": "fsdp+tp+pp+compile+activation_checkpointing",
        "world_size": 8,
        "dp": 2,
        "cp": 1,
        "tp": 2,
        "pp": 2,
        "grad_accum": 4,
        "max_abs_dloss": 1.234e-7,
        "max_abs_dparam": 5.678e-8,
        "final_loss_gap": 0.0123,
        "passed": True,
    }
    _table([rec, {**rec, "strategy": "ddp", "passed": False}], 1e-5, 1e-5, 20)
    out = piped()
    for v in (rec["strategy"], "2·1·2·2", "1.234e-07", "5.678e-08", "+1.23% (judged)", "pass", "FAIL"):
        assert v in out, (v, out)


def test_bench_optim_comm_peak_tables_whole_in_a_pipe(piped):
    from loom.bench import comm, optim, peak

    optim.print_table(
        [
            {
                "impl": "torch-foreach-with-a-long-name",
                "time_ms": 12345.678,
                "time_ms_min": 12000.125,
                "bandwidth_gbps": 98765.4,
                "fraction_of_copy": 0.876,
                "speedup_vs_torch_fused": 1.2345,
                "n_params": 124_439_808,
                "n_tensors": 148,
                "model": {"n_layer": 12, "n_embd": 768, "vocab_size": 50304},
                "device_name": "a CPU with a long marketing name (R) Xeon(R) Platinum 8480+",
                "bytes_per_step": 28 * 124_439_808,
                "copy_bandwidth_gbps": 12.5,
                "copy_bytes": 2**28,
            }
        ]
    )
    comm.print_table(
        [
            {
                "backend": "gloo-over-loopback",
                "op": "reduce_scatter_tensor",
                "bytes": 2**30,
                "time_us": 123456789.1,
                "algbw_gbps": 1234.567,
                "busbw_gbps": 2345.678,
                "world_size": 4,
                "dtype": "bf16",
            }
        ]
    )
    peak.print_table(
        [
            {
                "what": "matmul",
                "dtype": "bf16",
                "flops": 123.456e12,
                "size": 8192,
                "datasheet_flops": 989e12,
                "fraction_of_datasheet": 0.1248,
            },
            {"what": "copy", "bandwidth_gbps": 4321.9, "bytes": 2**30},
        ],
        "loom bench peak: NVIDIA H200 with a long name",
    )
    out = piped()
    expected = (
        "torch-foreach-with-a-long-name 12345.68 12000.12 98765.4 88% 1.23x gloo-over-loopback "
        "reduce_scatter_tensor 123456789.1 1234.567 2345.678 n=8192 12.5%"
    )
    for v in [*expected.split(), "123.456 TFLOP/s", "989 TFLOP/s", "4321.9 GB/s", "1024 MiB"]:
        assert v in out, (v, out)


def test_doctor_table_whole_in_a_pipe(piped):
    from loom.doctor import _print_devices

    dev = {
        "index": 0,
        "name": "NVIDIA H200 with a very long product name for this test",
        "memory_gib": 139.8,
        "capability": "9.0",
        "multiprocessors": 132,
        "bf16": True,
        "tf32": True,
        "fp8": True,
    }
    _print_devices(log.console(), {"devices": [dev, dev], "torch": {"mps_available": False}})
    out = piped()
    for v in (dev["name"], "139.8 GiB", "9.0", "132"):
        assert v in out, (v, out)


def test_bench_generate_line_whole_in_a_pipe(piped):
    from loom.bench.generate import _line

    r = {"kind": "decode", "batch": 64, "loom": {"prefill_tok_s": 123456.7, "decode_tok_s": 98765.4}}
    log.info(_line(r))
    out = piped()
    assert "loom prefill 123457 decode 98765 tok/s" in out.replace("\n", " "), out


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them():
    """COLUMNS=60 on a terminal: the table keeps the terminal's width and every digit is shown."""
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=60, color_system=None, highlight=False)
    t = Table(title="narrow")
    for c in ("mode", "tokens/s", "ms/step", "peak mem", "compile", "comm"):
        t.add_column(c, no_wrap=True)
    numbers = ["1,234,567,890", "12345.678", "98765432 MiB", "123456.7s", "37%"]
    t.add_row("activation_checkpointing=selective", *numbers)
    log.print_table(t, con)
    out = buf.getvalue()
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines()) <= 60, out
    # a folded cell reads whole once its column's pieces, line by line, are joined
    rows = [re.split(r"[│┃]", line)[1:-1] for line in out.splitlines() if line.startswith(("│", "┃"))]
    columns = ["".join(piece.strip() for piece in col) for col in zip(*rows, strict=True)]
    for v, col in zip(["activation_checkpointing=selective", *numbers], columns, strict=True):
        assert v.replace(" ", "") in col.replace(" ", ""), (v, out)
