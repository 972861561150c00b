"""Each block kind's share of a UNet call (choose="auto", first stage), kept in the environment's cache directory.

The share decides whether a kind is compiled at all. Measured again in every process, a kind near the threshold
could fall on the other side of it from one process to the next, and the persistent cache would then hold no
graph for it: the later process would compile it cold. So a share is measured once per environment and kind (the
block's class and parameter signature, device and torch; not the compile options, which do not change eager
timing), and later processes read it. `python -m accel cache clear` forgets it with the rest of the cache.
"""
from __future__ import annotations

import json
import logging
import threading

from ..cache import COMPILE_CACHE
from ..cache.store import SHARES_FILE, write_atomic

log = logging.getLogger("comfyui_accel")
_lock = threading.Lock()


def _path(device_type: str):
    env = COMPILE_CACHE.environment(device_type)
    return env.dir / SHARES_FILE if env.check_usable() else None


def _read(path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: measured again, then rewritten


def saved_share(device_type: str, kind_id: str) -> float | None:
    path = _path(device_type)
    value = _read(path).get(kind_id) if path is not None else None
    return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None


def save_share(device_type: str, kind_id: str, share: float) -> None:
    path = _path(device_type)
    if path is None:
        return
    with _lock:  # read, add, replace: another process's concurrent write may be lost, and is then re-measured
        shares = _read(path)
        shares[kind_id] = round(share, 5)
        try:
            write_atomic(path, json.dumps(shares, indent=1, sort_keys=True).encode())
        except OSError as err:
            log.warning("[Accel] compile cache: could not save block shares to %s (%s); the next process measures "
                        "them again.", path, err)
