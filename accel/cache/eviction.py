"""The compile cache's size cap (ACCEL_CACHE_MAX_GB): the whole cache root is kept under it, least recently used
first, going by each compile key's `last_used` (touched at each load or save)."""
from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..env_settings import env_float
from .files import tree_size
from .location import environment_dirs
from .trust import make_private_dirs

if TYPE_CHECKING:
    from .store import EnvironmentCache

log = logging.getLogger("comfyui_accel")

MAX_SIZE_ENV = "ACCEL_CACHE_MAX_GB"
DEFAULT_MAX_GB = 10.0
EVICT_EVERY_S = 30.0  # sizing a cache walks its files: at most this often per process


class Eviction:
    """Keep the cache root under its cap, from one environment's point of view: its own keys in use are kept."""

    def __init__(self, env: EnvironmentCache):
        self.env = env
        self._last_evict = 0.0

    def evict_if_needed(self, force: bool = False) -> None:
        """Keep the whole cache root under ACCEL_CACHE_MAX_GB, least recently used first: other environments'
        directories, then this environment's compile keys not used by this process."""
        env = self.env
        now = time.monotonic()
        if not force and now - self._last_evict < EVICT_EVERY_S:
            return
        self._last_evict = now
        cap_gb = env_float(MAX_SIZE_ENV, DEFAULT_MAX_GB, allow_inf=True)
        if cap_gb == math.inf:  # no cap
            return
        cap = int(cap_gb * 2**30)
        sizes = {path: tree_size(path) for path in {*environment_dirs(env.dir.parent), env.dir}}
        total = sum(sizes.values())
        if total <= cap:
            return
        candidates = [(_environment_last_used(path), path, size) for path, size in sizes.items() if path != env.dir]
        for key_dir in env.artifacts_dir.iterdir():
            if key_dir.is_dir() and key_dir.name not in env.artifacts.loaded:
                candidates.append((_last_used(key_dir), key_dir, tree_size(key_dir)))
        for _, path, size in sorted(candidates, key=lambda c: c[0]):
            if total <= cap:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            env.stats["evicted"] += 1
            log.info("[Accel] compile cache: evicted %s (%.1f MB, least recently used) to stay under %s GB",
                     path, size / 2**20, cap / 2**30)
        if total > cap:
            # torch's working cache alone is over the cap: start it afresh; the artifacts rebuild it on demand
            shutil.rmtree(env.inductor_dir, ignore_errors=True)
            make_private_dirs(env.inductor_dir)
            env.artifacts.forget_loaded()
            env.stats["evicted"] += 1


def _last_used(path: Path) -> float:
    for candidate in (path / "last_used", path):
        with contextlib.suppress(OSError):
            return candidate.stat().st_mtime
    return 0.0


def _environment_last_used(env_dir: Path) -> float:
    """An environment's last use: its compile keys' (each load or save touches the key's), or the folder's own
    time. The folder's time alone barely changes while workers use it on a shared volume."""
    keys = env_dir / "artifacts"
    found = [_last_used(key) for key in keys.iterdir() if key.is_dir()] if keys.is_dir() else []
    return max([_last_used(env_dir), *found])
