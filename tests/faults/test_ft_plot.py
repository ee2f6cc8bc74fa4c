"""`loom plot` marks torchft quorum changes (loom.plot.mark_quorum_changes): compared against the records a
run with a group killed and restarted writes (the shape tests/faults/test_ft_ddp.py checks)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loom.plot import mark_quorum_changes, plot_runs  # noqa: E402

QUORUM = {"quorum_s": 0.01, "healed_peers": []}
RECS = [
    {"step": 0, "ft": {"quorum_id": 1, "replicas": [0, 1], "joined": [0, 1], "left": [], **QUORUM}},
    *({"step": s, "loss": 3.0, "tokens": 256 * s, "ft_replicas": 2} for s in range(1, 6)),
    {"step": 5, "ft": {"quorum_id": 2, "replicas": [0], "joined": [], "left": [1], **QUORUM}},
    *({"step": s, "loss": 2.9, "tokens": 256 * s, "ft_replicas": 1} for s in range(6, 9)),
    {"step": 8, "ft": {"quorum_id": 3, "replicas": [0, 1], "joined": [1], "left": [], **QUORUM}},
]


def test_quorum_changes_are_marked_after_the_first():
    fig, ax = plt.subplots()
    assert mark_quorum_changes(ax, RECS, "C0") == [5 * 256, 8 * 256]
    assert [ln.get_xdata()[0] for ln in ax.lines if ln.get_gid() == "ft"] == [5 * 256, 8 * 256]
    assert [t.get_text() for t in ax.texts] == ["-g1", "+g1"]
    plt.close(fig)


def test_plot_of_an_ft_run_writes_its_image(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECS))
    out = plot_runs([run])
    assert out.is_file() and out.stat().st_size > 0
