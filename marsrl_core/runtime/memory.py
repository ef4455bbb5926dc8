"""Return the C allocator's free memory to the operating system, periodically.

glibc's malloc keeps what a program frees inside its arenas (the main heap and one arena per thread
that allocated, up to 8 per core) and gives it back on its own only from the top of a heap. A worker
whose threads allocate and free tensors all day (decoding segments, reloading weights) therefore
keeps tens of MB of free pages resident: in a 25-minute soak a rollout's thread arenas grew 100 -> 146
MB, while the memory malloc had handed out stayed flat (218-275 MB). `malloc_trim(0)` walks every
arena and returns its free pages (madvise); in a soak each call returned 30-160 MB and took 8-47 ms.
DuckDB calls it on its own, so a process that runs DuckDB queries needs this less.

`MemoryTrimmer(every_s)` calls it from a daemon thread every `every_s` seconds; `trim()` calls it once.
Deliberate simplifications: glibc only (elsewhere nothing is trimmed and `trim()` returns False); on a
timer, not triggered by growth (a call is cheap next to a minute of work).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): no malloc_trim
        return None
    if function is not None:
        function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


_MALLOC_TRIM = _load_malloc_trim()


def trim() -> bool:
    """Return free allocator memory to the OS now; whether this platform can (glibc)."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class MemoryTrimmer:
    """A daemon thread that calls `trim()` every `every_s` seconds until `stop()`."""

    def __init__(self, every_s: float):
        if every_s <= 0:
            raise ValueError(f"MemoryTrimmer: every_s={every_s} must be > 0")
        self.every_s = every_s
        self.trims = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="marsrl-memory-trimmer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            if not trim():
                return
            self.trims += 1

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
