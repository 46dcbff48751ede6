"""Memory while a call runs: host bytes in use (sampled by a thread), the device's peak allocation,
and minor page faults.

What is measured, exactly:

- **host**: bytes the C allocator has handed out and not taken back (glibc ``mallinfo2``: all arenas
  plus mmapped blocks), where torch's CPU tensors live; the RSS where there is no ``mallinfo2``. The
  peak above the level at start, sampled every millisecond and once more at the end.
- **device**: on a CUDA or XPU device, the peak of ``torch.<device>.max_memory_allocated()`` (torch's
  caching allocator: bytes in tensors, not the blocks it caches) above ``memory_allocated()`` at
  start, after a ``reset_peak_memory_stats()``. On the CPU, or where the device module lacks those
  calls, 0.
- **faults**: this process's minor page faults (POSIX ``getrusage``; 0 where there is none).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from types import TracebackType
from typing import Any, Callable

import torch

__all__ = ["host_bytes_in_use", "PeakHost", "DeviceMemory", "minor_faults"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def host_bytes_in_use() -> Callable[[], int]:
    """A function returning the bytes the C allocator has handed out and not taken back (glibc
    ``mallinfo2``). Unlike RSS it falls when memory is freed, so a peak above the level at start is the
    memory a call really held. Falls back to RSS elsewhere. Call anywhere; the function it returns too."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2

        def in_use() -> int:
            info = libc.mallinfo2()
            return int(info.uordblks + info.hblkhd)

        in_use()
        return in_use
    except (OSError, AttributeError):
        page = os.sysconf("SC_PAGE_SIZE")

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * page

        return rss


class PeakHost:
    """Peak host memory in use above the level at start, sampled every millisecond by a thread (which
    takes the GIL each time: do not time Python inside the block). Use as a context manager; ``extra``
    is read after the block."""

    def __init__(self, measure: Callable[[], int] | None = None) -> None:
        self._measure = measure or host_bytes_in_use()
        self.base = self.peak = 0

    def __enter__(self) -> PeakHost:
        # garbage left from before the block, collected inside it, would lower the level below the start
        # and hide that much of what the block held: collected first
        gc.collect()
        self.base = self.peak = self._measure()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._measure())

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._measure())

    @property
    def extra(self) -> int:
        """Bytes above the level at the start of the block, at the peak."""
        return max(0, self.peak - self.base)


_CALLS = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated")


class DeviceMemory:
    """The peak allocation of torch's caching allocator on a CUDA or XPU device, above the level at
    ``start()``; ``measured`` is False (and ``extra()`` 0) on the CPU or where ``torch.<device>`` lacks
    the calls. Call ``start()`` and ``extra()`` on the rank that owns ``device``. ``module``: the device
    module to ask (default ``torch.cuda`` or ``torch.xpu`` by the device's type)."""

    def __init__(self, device: torch.device, module: Any = None) -> None:
        if module is None and device.type in ("cuda", "xpu"):
            module = getattr(torch, device.type, None)
        self.measured = module is not None and all(hasattr(module, name) for name in _CALLS)
        self._module = module
        self._device = device
        self._base = 0

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing on the CPU)."""
        if self._module is not None and hasattr(self._module, "synchronize"):
            self._module.synchronize(self._device)

    def start(self) -> None:
        """Synchronize, reset the peak and take the level now as the base."""
        if self.measured:
            self.synchronize()
            self._module.reset_peak_memory_stats(self._device)
            self._base = int(self._module.memory_allocated(self._device))

    def extra(self) -> int:
        """Peak bytes allocated above the base since ``start()`` (synchronize first)."""
        if not self.measured:
            return 0
        return max(0, int(self._module.max_memory_allocated(self._device)) - self._base)


def minor_faults() -> int:
    """This process's minor page faults so far (POSIX ``getrusage``; 0 where there is none). A call
    whose fresh buffers get pages the C allocator had given back to the system pays one fault per page
    on first touch, and whether it does depends on what the allocator did before, not on the method:
    the faults column tells those calls apart. Call anywhere."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
