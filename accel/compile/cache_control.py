"""Clearing the compile cache from a running ComfyUI (the web UI's panel): only when nothing compiles, in this
process or in its background child, so no half-written artifact and no job folder is pulled from under a compile.
"""
from __future__ import annotations

from ..cache import CacheBusy, cache_root, clear_disk_cache, disk_info
from .background import BACKGROUND


def cache_on_disk() -> dict:
    """The cache root, and each environment's compile keys and size on disk."""
    return disk_info(cache_root())


def clear_cache() -> dict:
    """Delete the persistent compile cache (every environment). Raises CacheBusy, changing nothing, while a
    background compile is running, queued or waiting, or a compile of this process is writing to the cache."""
    if BACKGROUND.busy or not BACKGROUND.retire_idle_worker():
        raise CacheBusy("a background compile is running or waiting; clear the cache once the Compile Model nodes "
                        "say compiled or eager")
    return clear_disk_cache(cache_root())
