"""glibc's header of the chunk behind an allocation: was it mmapped, which arena holds it.

The word before the pointer malloc returns is the chunk's size with three flag bits: IS_MMAPPED (0x2) and
NON_MAIN_ARENA (0x4). A chunk of a thread's arena lies in a 64 MiB-aligned heap whose first word names its arena.
torch's CPU tensors come from posix_memalign, so a tensor's data_ptr() is such a pointer. Reads go through
/proc/self/mem: a pointer that is not malloc's (a tensor viewing a file mapping) reads as unknown instead of
crashing the process.
"""
from __future__ import annotations

import os
import struct

from .glibc import libc

IS_MMAPPED, NON_MAIN_ARENA = 0x2, 0x4
HEAP_MAX = 64 << 20  # a non-main arena's heap on 64-bit glibc (2 * DEFAULT_MMAP_THRESHOLD_MAX), aligned to it


def _read_word(address: int) -> int | None:
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, 8, address)
    except (OSError, OverflowError, ValueError):
        return None
    finally:
        os.close(fd)
    return struct.unpack("<Q", data)[0] if len(data) == 8 else None


def chunk_of(pointer: int) -> dict:
    """{"mmapped": bool, "main_arena": bool, "arena": hex of a thread arena or "main", "chunk_bytes": int}, or {}
    where unknown (not glibc, unreadable)."""
    if libc() is None or pointer < 16:
        return {}
    size = _read_word(pointer - 8)
    if size is None:
        return {}
    found = {"mmapped": bool(size & IS_MMAPPED), "main_arena": not size & NON_MAIN_ARENA,
             "chunk_bytes": size & ~0x7}
    if found["mmapped"]:
        found["arena"] = None  # an mmapped chunk belongs to no arena
    elif found["main_arena"]:
        found["arena"] = "main"
    else:
        arena = _read_word(pointer & ~(HEAP_MAX - 1))  # heap_info.ar_ptr
        found["arena"] = hex(arena) if arena else None
    return found


def tensor_chunk(tensor) -> dict:
    """chunk_of a CPU tensor's storage (its first byte, not a view's offset)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return {}
    return chunk_of(pointer) if tensor.device.type == "cpu" else {}
