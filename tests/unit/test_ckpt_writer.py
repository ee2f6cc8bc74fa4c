"""The background checkpoint writer yields the cores to the training loop: its thread (and threads it starts)
run at nice 10 while the loop's thread keeps its priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from loom.train.checkpointing import _yield_cores


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux behaviour")
def test_writer_thread_runs_at_low_priority_and_the_loop_does_not():
    seen = {}

    def writer():
        _yield_cores()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(
            target=lambda: seen.__setitem__(
                "child", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
        )
        child.start()
        child.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen == {"writer": 10, "child": 10}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
