"""The pack's threads, started under a native name of their own, so that work they should not do shows.

Linux gives a new thread the name of the thread that starts it, and libgomp starts the workers of an OpenMP pool
from the thread that opens its first parallel region (ATen's CPU kernels do). So if one of the pack's threads ever
runs a CPU kernel, the pool it opens for it - threads that spin beside the sampler's pool and slow every step (#32:
a process that loaded its graphs stepped slower than one that compiled them) - carries that thread's name, and
diagnostics.pools_of_pack_threads() finds it. Python before 3.14 names threads only for itself, so each thread
names itself natively first thing (prctl PR_SET_NAME; elsewhere than Linux nothing happens).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

PREFIX = "accel-"
NATIVE_LIMIT = 15  # bytes a native thread name holds, without its terminating NUL (prctl(2))
_PR_SET_NAME = 15


def start_thread(name: str, target, *args, daemon: bool = True) -> threading.Thread:
    """Start `target(*args)` in a thread named `name` for Python and natively."""
    assert name.startswith(PREFIX) and len(name.encode()) <= NATIVE_LIMIT, f"{name!r}: a native name of the pack"

    def run() -> None:
        name_this_thread(name)
        target(*args)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def name_this_thread(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:NATIVE_LIMIT]), 0, 0, 0)
    except (OSError, AttributeError):  # no libc by that name: the thread keeps its inherited name
        pass
