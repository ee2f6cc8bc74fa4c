"""ft.heartbeat_s (issue 59, the chaos benchmark's fixed cost): the lighthouse `loom train --nproc` starts drops a
replica group from the quorum after that many seconds without a heartbeat (the survivors' one wait after a
failure: benchmarks/results/cpu-2core-2026-12-02/chaos.md). Checked against the lighthouse's own arguments (a
stand-in records them)."""

from __future__ import annotations

import pytest

from loom.config import Config


class _Lighthouse:
    """torchft's LighthouseServer, recording what it was started with."""

    seen: dict = {}

    def __init__(self, **kw):
        _Lighthouse.seen = kw

    def address(self) -> str:
        return "http://127.0.0.1:29999"

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(("beat", "ms"), [(None, 2000), (0.5, 500), (0.25, 250)])
def test_the_lighthouse_drops_a_silent_group_after_ft_heartbeat_s(monkeypatch, beat, ms):
    pytest.importorskip("torchft")
    import torchft._torchft

    from loom.distributed import ft

    monkeypatch.setattr(torchft._torchft, "LighthouseServer", _Lighthouse)
    cfg = Config()
    if beat is not None:
        cfg.ft.heartbeat_s = beat
    with ft.lighthouse(cfg, 2) as url:
        assert url == "http://127.0.0.1:29999"
    assert _Lighthouse.seen["heartbeat_timeout_ms"] == ms
    assert _Lighthouse.seen["bind"].startswith("127.0.0.1:")
