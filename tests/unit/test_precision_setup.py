"""precision.dtype=auto (loom.train.setup) and the CPU allocator settings (loom.env) against what they promise:
auto follows the device's bf16 support (fixed answers for stubbed /proc/cpuinfo flags and GPU capabilities);
cpu_memory_reuse applies glibc's options inside and restores them: the mallopt calls against <malloc.h>'s
constants and glibc's documented defaults, and the effect on malloc itself read back from each block's chunk header."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom import env as loom_env
from loom.env import cpu_memory_reuse, native_bf16_cpu
from loom.train.setup import resolve_precision


def test_explicit_dtypes_pass_through():
    for d in ("fp32", "bf16", "fp16"):
        assert resolve_precision(d, torch.device("cpu")) == d


class _CpuInfo:
    def __init__(self, text: str):
        self.text = text

    def __call__(self, path):
        assert str(path) == "/proc/cpuinfo"
        return self

    def read_text(self, **_):
        return self.text


@pytest.mark.parametrize(
    "flags,bf16_units,want",
    [
        ("fpu sse2 avx2 avx512f avx512bw", False, "fp32"),  # AVX-512 without its BF16 extension
        ("fpu sse2 avx2 avx512f avx512_bf16", True, "bf16"),  # Cooper Lake, Zen 4
        ("fpu sse2 avx2 amx_bf16 amx_tile", True, "bf16"),  # Sapphire Rapids
        ("fpu asimd bf16", False, "fp32"),  # an Arm flag of that name is not one of the x86 units
        ("", False, "fp32"),
    ],
)
def test_auto_on_cpu_follows_bf16_units(monkeypatch, flags, bf16_units, want):
    monkeypatch.setattr(loom_env, "Path", _CpuInfo(f"processor\t: 0\nflags\t\t: {flags}\n"))
    assert native_bf16_cpu() is bf16_units
    assert resolve_precision("auto", torch.device("cpu")) == want
    assert resolve_precision("auto", torch.device("meta")) == "fp32"


def test_auto_on_cpu_without_cpuinfo(monkeypatch):
    class Missing(_CpuInfo):
        def read_text(self, **_):
            raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr(loom_env, "Path", Missing(""))
    assert native_bf16_cpu() is False
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"


@pytest.mark.parametrize("bf16,want", [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda(monkeypatch, bf16, want):
    # the GPU's answer is stubbed so this runs without one: Ampere and later -> bf16, older -> fp16 + scaling
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto", torch.device("cuda")) == want
    # pipeline parallel cannot scale the loss (config refuses an explicit fp16 with pp > 1): fp32 then
    assert resolve_precision("auto", torch.device("cuda"), loss_scaling=False) == ("bf16" if bf16 else "fp32")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # <malloc.h>
GLIBC_DEFAULTS = [(M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024)]  # mallopt(3): DEFAULT_MMAP_MAX etc.


class _FakeLibc:
    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake_glibc(monkeypatch):
    libc, opened = _FakeLibc(), []
    monkeypatch.setattr(loom_env.sys, "platform", "linux")
    monkeypatch.setattr(loom_env.platform, "libc_ver", lambda *a, **k: ("glibc", "2.36"))
    monkeypatch.setattr(loom_env.ctypes, "CDLL", lambda name: opened.append(name) or libc)
    return libc, opened


def test_cpu_memory_reuse_sets_and_restores_mallopt(fake_glibc):
    libc, opened = fake_glibc
    with cpu_memory_reuse(True) as applied:
        assert applied is True and opened == ["libc.so.6"]
        assert libc.calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30)]
    assert libc.calls[2:] == GLIBC_DEFAULTS
    libc.calls.clear()
    with pytest.raises(RuntimeError), cpu_memory_reuse(True):
        raise RuntimeError("a failed step")  # restored on the way out of an error too
    assert libc.calls[2:] == GLIBC_DEFAULTS


def test_cpu_memory_reuse_disabled_or_without_glibc(fake_glibc, monkeypatch):
    libc, opened = fake_glibc
    with cpu_memory_reuse(False) as applied:
        assert applied is False
    monkeypatch.setattr(loom_env.platform, "libc_ver", lambda *a, **k: ("", ""))  # musl
    with cpu_memory_reuse(True) as applied:
        assert applied is False
    assert opened == [] and libc.calls == []


def test_cpu_memory_release_sets_a_fixed_mmap_threshold(fake_glibc):
    """eval/generate set only the mmap threshold; loom data prepare also a trim threshold of 8 MiB."""
    libc, opened = fake_glibc
    assert loom_env.cpu_memory_release() is True
    assert libc.calls == [(M_MMAP_THRESHOLD, 1 << 20)]
    libc.calls.clear()
    assert loom_env.cpu_memory_release(trim_threshold=8 << 20) is True
    assert libc.calls == [(M_MMAP_THRESHOLD, 1 << 20), (M_TRIM_THRESHOLD, 8 << 20)]


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc's malloc only"
)
def _mmapped_probe():
    """mmapped(size): whether glibc's malloc serves a block of that size with mmap, read from the block's own
    chunk header (the size word before it; bit 1, IS_MMAPPED). Not from mallinfo2's process-wide count of mmapped
    blocks, which another thread's allocations (a test's leftover thread, torch's pool) change meanwhile: under
    load that read a 256 MiB block as not mmapped."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    word = ctypes.sizeof(ctypes.c_size_t)

    def mmapped(size: int) -> bool:
        ptr = libc.malloc(size)  # never touched: address space only
        assert ptr
        try:
            return bool(ctypes.c_size_t.from_address(ptr - word).value & 0x2)
        finally:
            libc.free(ptr)

    return mmapped


_REUSE_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from test_precision_setup import _mmapped_probe
from loom.env import cpu_memory_reuse
mmapped = _mmapped_probe()
big = 256 << 20  # above glibc's largest dynamic mmap threshold (32 MiB), larger than any free heap
before = mmapped(big)
with cpu_memory_reuse(True) as applied:
    inside = mmapped(64 << 20)
print(before, applied, inside, mmapped(big))
"""


def test_cpu_memory_reuse_changes_what_malloc_does():
    """The real allocator: a block far above the mmap threshold is mmapped outside, taken from the heap inside,
    and mmapped again after. In a fresh interpreter: in a pytest worker that ran other files first, the 256 MiB
    block already came from the heap before the context in 2 of 3 fresh clones (something an earlier test ran
    left mmap off process-wide; not found yet)."""
    _mmapped_probe()  # skips without glibc
    r = subprocess.run(
        [sys.executable, "-c", _REUSE_PROBE, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "False", "True"], r.stdout


_RELEASE_PROBE = """
import ctypes, sys
from loom.env import cpu_memory_release
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(24 << 20))  # an mmapped block freed: glibc raises its threshold to 24 MiB
if sys.argv[1] == "release":
    cpu_memory_release()
blocks = [libc.malloc(8 << 20) for _ in range(4)]  # all-gather buffers of 8 MiB, touched, then freed
for b in blocks:
    ctypes.memset(b, 1, 8 << 20)
for b in blocks:
    libc.free(b)
print(sum(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")))
"""


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc's malloc only"
)
def test_cpu_memory_release_gives_large_freed_blocks_back():
    """The sharded eval's setting, in fresh interpreters: once glibc has raised its mmap threshold, 8 MiB blocks
    come from the heap and stay there after free (RSS grows by them, here 32 MiB once touched); with
    cpu_memory_release they are mmapped and unmapped when freed."""
    import subprocess

    rss = {}
    for mode in ("default", "release"):
        r = subprocess.run(
            [sys.executable, "-c", _RELEASE_PROBE, mode], capture_output=True, text=True, check=True
        )
        rss[mode] = int(r.stdout.strip())  # KiB
    assert rss["default"] - rss["release"] > 16 << 10
