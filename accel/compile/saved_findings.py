"""Each block kind's share of a UNet call (choose="auto", first stage), kept in the environment's cache directory.

The share decides whether a kind is compiled at all. Measured again in every process, a kind near the threshold
could fall on the other side of it from one process to the next, and the persistent cache would then hold no
graph for it: the later process would compile it cold. So a share is measured once per environment and kind (the
block's class and parameter signature, device and torch; not the compile options, which do not change eager
timing), and later processes read it. `python -m accel cache clear` forgets it with the rest of the cache. With a
remote store (cache/remote.py), shares are published there, signed, and a worker reads the fleet's shares where
its own directory has none.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from ..cache import COMPILE_CACHE
from ..cache.remote import remote_store
from ..cache.store import SHARES_FILE, write_atomic

log = logging.getLogger("comfyui_accel")
_lock = threading.Lock()
_known: dict[Path, dict] = {}  # each shares file as this process read or last wrote it: read once, not per kind


def _remote_shares(device_type: str) -> dict:
    """The store's shares for this environment, verified (none without a store, or when it fails)."""
    remote = remote_store()
    return {} if remote is None else remote.shares(COMPILE_CACHE.environment(device_type).env_id)


def _path(device_type: str) -> Path | None:
    env = COMPILE_CACHE.environment(device_type)
    return env.dir / SHARES_FILE if env.check_usable() else None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: measured again, then rewritten


def saved_share(device_type: str, kind_id: str) -> float | None:
    path = _path(device_type)
    if path is None:
        return None
    with _lock:
        if path not in _known:
            _known[path] = {**_remote_shares(device_type), **_read(path)}  # what this machine measured wins
        value = _known[path].get(kind_id)
    return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None


def save_shares(device_type: str, shares: dict[str, float]) -> None:
    """Add the shares one profile call measured, in one write."""
    path = _path(device_type)
    if path is None or not shares:
        return
    remote = remote_store()
    if remote is not None:
        remote.publish_shares(COMPILE_CACHE.environment(device_type).env_id, shares)
    with _lock:  # read, add, replace: another process's concurrent write may be lost, and is then re-measured
        current = _read(path)  # from disk, to keep what other processes saved meanwhile
        current.update({kind_id: round(share, 5) for kind_id, share in shares.items()})
        _known[path] = current
        try:
            write_atomic(path, json.dumps(current, indent=1, sort_keys=True).encode())
        except OSError as err:
            log.warning("[Accel] compile cache: could not save block shares to %s (%s); the next process measures "
                        "them again.", path, err)
