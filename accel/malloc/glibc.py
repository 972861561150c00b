"""glibc malloc's live parameters, read in place without changing them (pure Python, ctypes).

glibc keeps them in a static `struct malloc_par mp_` that no symbol exports. Its tcache fields default to
{64 bins, 1032 bytes, 7 per bin} on 64-bit glibc 2.26+, three words in a row that are easy to find in libc's
writable data; the fields before them are the thresholds. A found copy is accepted only when its mmap count and
bytes equal what `mallinfo2` says (the same two counters, read through glibc's own API), so a wrong layout or a
chance match reads as unknown, never as a wrong number. Two layouts: glibc 2.35 added three hugepage fields
between the thresholds and the mmap counters.

Nothing here writes to glibc's memory; `mallopt` is called only by tune.py.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt(3)
TCACHE_DEFAULTS = (64, 1032, 7)  # mp_.tcache_bins, tcache_max_bytes, tcache_count
# Byte offsets from &mp_.tcache_bins, per layout: (trim_threshold, top_pad, mmap_threshold, arena_max, n_mmaps,
# n_mmaps_max, no_dyn_threshold, mmapped_mem). glibc >= 2.35 has thp_pagesize, hp_pagesize, hp_flags after
# arena_max (malloc.c, struct malloc_par).
LAYOUTS = {
    "2.35+": (-104, -96, -88, -72, -44, -40, -32, -24),
    "2.26-2.34": (-80, -72, -64, -48, -40, -36, -28, -24),
}


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def glibc_version() -> str | None:
    """"2.36", or None off glibc (musl, macOS, Windows)."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    return text.split()[1] if text and text.startswith("glibc ") else None


def version_tuple(version: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in (version or "").split(".")[:2])
    except ValueError:
        return ()


_libc = None
_libc_lock = threading.Lock()


def libc():
    """glibc's handle with the prototypes used here, or None off Linux glibc."""
    global _libc
    with _libc_lock:
        if _libc is None:
            _libc = False
            if sys.platform.startswith("linux") and glibc_version():
                try:
                    handle = ctypes.CDLL("libc.so.6", use_errno=True)
                    handle.mallopt.argtypes, handle.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                    if hasattr(handle, "mallinfo2"):  # glibc 2.33+
                        handle.mallinfo2.restype = MallInfo2
                    _libc = handle
                except (OSError, AttributeError):
                    pass
        return _libc or None


def mallinfo2() -> dict:
    """glibc's own totals (main arena and threads' arenas), {} where unknown."""
    handle = libc()
    if handle is None or not hasattr(handle, "mallinfo2"):
        return {}
    info = handle.mallinfo2()
    return {"heap_bytes": info.arena, "mmapped_chunks": info.hblks, "mmapped_bytes": info.hblkhd,
            "free_bytes": info.fordblks, "main_top_bytes": info.keepcost}


def _libc_writable_ranges() -> list[tuple[int, int]]:
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and fields[1].startswith("rw") and os.path.basename(fields[5]).startswith(
                        "libc.so"):
                    low, high = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((low, high))
    except OSError:
        pass
    return ranges


def _word(address: int) -> int:
    return ctypes.c_size_t.from_address(address).value


def _int(address: int) -> int:
    return ctypes.c_int.from_address(address).value


def _matches(anchor: int, offsets: tuple, info: dict) -> bool:
    return (_int(anchor + offsets[4]) == info["mmapped_chunks"]
            and _word(anchor + offsets[7]) == info["mmapped_bytes"])


class _Found:
    anchor: int | None = None
    layout: str | None = None
    searched = False


_found = _Found()
_search_lock = threading.Lock()


def _find() -> tuple[int, str] | None:
    """(&mp_.tcache_bins, layout), searched once per process (the address does not move)."""
    with _search_lock:
        if _found.searched:
            return (_found.anchor, _found.layout) if _found.anchor else None
        _found.searched = True
        if libc() is None or not hasattr(libc(), "mallinfo2"):
            return None
        preferred = "2.35+" if version_tuple(glibc_version()) >= (2, 35) else "2.26-2.34"
        order = [preferred] + [name for name in LAYOUTS if name != preferred]
        for low, high in _libc_writable_ranges():
            words = memoryview(ctypes.string_at(low, high - low)).cast("Q")
            for index in range(16, len(words) - 3):
                if tuple(words[index:index + 3]) != TCACHE_DEFAULTS:
                    continue
                anchor = low + index * 8
                for _ in range(3):  # another thread may map or unmap between the two reads
                    info = mallinfo2()
                    layout = next((name for name in order if _matches(anchor, LAYOUTS[name], info)), None)
                    if layout:
                        _found.anchor, _found.layout = anchor, layout
                        return anchor, layout
        return None


def params() -> dict:
    """The live malloc parameters: mmap_threshold, trim_threshold, top_pad (bytes), dynamic (glibc still moves
    the mmap and trim thresholds itself: no mallopt or MALLOC_*_ has frozen them), arena_max (0: glibc's
    default), mmaps_max, the mmapped chunks and bytes (equal to mallinfo2's: the check), and the layout read. {} where unknown (not glibc, no mallinfo2, not found or not
    confirmed by mallinfo2 now)."""
    found = _find()
    if found is None:
        return {}
    anchor, layout = found
    offsets = LAYOUTS[layout]
    for _ in range(3):
        info = mallinfo2()
        if _matches(anchor, offsets, info):
            return {"mmap_threshold": _word(anchor + offsets[2]), "trim_threshold": _word(anchor + offsets[0]),
                    "top_pad": _word(anchor + offsets[1]), "dynamic": _int(anchor + offsets[6]) == 0,
                    "arena_max": _word(anchor + offsets[3]), "mmaps_max": _int(anchor + offsets[5]),
                    "mmapped_chunks": info["mmapped_chunks"], "mmapped_bytes": info["mmapped_bytes"],
                    "layout": layout}
    return {}
