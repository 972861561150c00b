"""Another C allocator in place of glibc's: tcmalloc, jemalloc or mimalloc, preloaded or mapped.

With one of them serving malloc, glibc's parameters describe an allocator nobody uses, and tuning them does
nothing: the tune (tune.py) stays off and the doctor says which allocator serves. Whether `malloc` itself is
glibc's is asked of the dynamic linker: the global lookup (dlopen(NULL)) finds a preloaded allocator's malloc
first.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys

from .glibc import libc
from .importers import mapped_libraries

ALTERNATIVES = re.compile(r"lib(tcmalloc\w*|jemalloc|mimalloc)[^/]*\.so")


def mapped_alternatives(pid: int | str = "self") -> list[str]:
    """The alternative allocator libraries mapped into pid, one path each."""
    return [path for path in mapped_libraries(pid) if ALTERNATIVES.match(os.path.basename(path))]


def preloaded_alternatives(env=None) -> list[str]:
    """The entries of LD_PRELOAD that name an alternative allocator."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    return [item for item in re.split(r"[:\s]+", preload) if item and ALTERNATIVES.search(os.path.basename(item))]


def malloc_is_glibcs() -> bool | None:
    """True when the process's `malloc` is glibc's own; None where that cannot be asked."""
    handle = libc()
    if handle is None or not sys.platform.startswith("linux"):
        return None
    try:
        global_malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
        glibc_malloc = ctypes.cast(handle.malloc, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return global_malloc == glibc_malloc


def alternative_allocator() -> dict:
    """{"mapped": [...], "preloaded": [...], "malloc_is_glibcs": bool | None}."""
    return {"mapped": mapped_alternatives(), "preloaded": preloaded_alternatives(),
            "malloc_is_glibcs": malloc_is_glibcs()}


def serves_malloc(found: dict) -> bool:
    """Another allocator serves (or may serve) this process's allocations."""
    return bool(found["mapped"] or found["preloaded"]) or found["malloc_is_glibcs"] is False
