"""What one process found about a block kind (choose="auto"), kept in the environment's cache directory for the
processes after it. Each finding is a JSON file of kind id -> value, read once per process:

- **Its share of a UNet call** (auto_call_shares.json, first stage), which decides whether a kind is compiled at
  all. Measured again in every process, a kind near the threshold could fall on the other side of it from one
  process to the next, and the persistent cache would then hold no graph for it: the later process would compile
  it cold. So a share is measured once per environment and kind (the block's class and parameter signature,
  device and torch; not the compile options, which do not change eager timing), and later processes read it.
  With a remote store (cache/remote.py), shares are published there, signed, and a worker reads the fleet's
  shares where its own directory has none.
- **That it compiles only in pieces** (auto_in_pieces.json: why). A child met a graph break in it, so no
  precompiled function can hold it and it runs eagerly (kind_choice.compiles_only_in_pieces). Found again, it
  would cost each restart a background job that saves nothing (Wan's VAE encode: a 13.8 s job on the 2-core CPU,
  2026-11-27). It travels as the shares do (exported, published to a remote store, signed), so a fleet finds it
  once. The kind id names torch's version, whose Dynamo decides what breaks a graph; the finding also keeps the
  code it was found on (ComfyUI's version and compute flags, the pack's version): after an update of either, whose
  model code may trace whole, it is found again. Not the compile options: a break comes from the Python Dynamo
  traces, before the backend or mode see a graph, and static or dynamic shapes broke Wan's VAE encode alike (21
  graphs each, torch._dynamo.explain, torch 2.11, 2026-11-28).

`python -m accel cache clear` forgets both with the rest of the cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Callable

from ..cache import COMPILE_CACHE
from ..cache.remote import remote_store
from ..cache.store import IN_PIECES_FILE, SHARES_FILE, write_atomic

log = logging.getLogger("comfyui_accel")
_lock = threading.Lock()
_known: dict[Path, dict] = {}  # each findings file as this process read or last wrote it: read once, not per kind


def _remote(device_type: str, table: str) -> dict:
    """The store's findings `table` ("shares" or "in_pieces") for this environment, verified (none without a
    store, or when it fails)."""
    remote = remote_store()
    return {} if remote is None else getattr(remote, table)(COMPILE_CACHE.environment(device_type).env_id)


def _path(device_type: str, name: str = SHARES_FILE) -> Path | None:
    env = COMPILE_CACHE.environment(device_type)
    return env.dir / name if env.check_usable() else None


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or damaged: measured again, then rewritten


def _merged(remote: dict, local: dict, usable: Callable[[object], bool]) -> dict:
    """What this machine found wins, except a finding this code cannot use (found on older code) over the store's
    that it can: the fleet found it again on this code, and taking it saves this worker the same background job."""
    merged = {**remote, **local}
    for kind_id, value in remote.items():
        if not usable(merged[kind_id]) and usable(value):
            merged[kind_id] = value
    return merged


def _saved(path: Path, kind_id: str, remote: Callable[[], dict] = dict,
           usable: Callable[[object], bool] = lambda value: True):
    with _lock:
        if path not in _known:
            _known[path] = _merged(remote(), _read(path), usable)
        return _known[path].get(kind_id)


def _save(path: Path, found: dict, what: str) -> None:
    with _lock:  # read, add, replace: another process's concurrent write may be lost, and is then found again
        current = _read(path)  # from disk, to keep what other processes saved meanwhile
        current.update(found)
        _known[path] = current
        try:
            write_atomic(path, json.dumps(current, indent=1, sort_keys=True).encode())
        except OSError as err:
            log.warning("[Accel] compile cache: could not save %s to %s (%s); the next process finds them again.",
                        what, path, err)


def saved_share(device_type: str, kind_id: str) -> float | None:
    path = _path(device_type)
    if path is None:
        return None
    value = _saved(path, kind_id, lambda: _remote(device_type, "shares"))
    return float(value) if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None


def save_shares(device_type: str, shares: dict[str, float]) -> None:
    """Add the shares one profile call measured, in one write."""
    path = _path(device_type)
    if path is None or not shares:
        return
    remote = remote_store()
    if remote is not None:
        remote.publish_shares(COMPILE_CACHE.environment(device_type).env_id, shares)
    _save(path, {kind_id: round(share, 5) for kind_id, share in shares.items()}, "block shares")


def _code() -> str:
    """A digest of the code a kind was traced in: ComfyUI's (version, compute flags, attention) and the pack's."""
    from .. import __version__
    from .precompiled import comfyui_identity

    return hashlib.sha256(json.dumps([comfyui_identity(), __version__]).encode()).hexdigest()[:16]


def saved_in_pieces(device_type: str, kind_id: str) -> str | None:
    """Why an earlier process, on this code, found the kind compiles only in pieces, or None."""
    path = _path(device_type, IN_PIECES_FILE)
    value = None if path is None else _saved(path, kind_id, lambda: _remote(device_type, "in_pieces"),
                                             _found_on_this_code)
    return str(value.get("why")) if _found_on_this_code(value) else None


def _found_on_this_code(value) -> bool:
    return isinstance(value, dict) and value.get("code") == _code()


def save_in_pieces(device_type: str, kind_id: str, why: str) -> None:
    path = _path(device_type, IN_PIECES_FILE)
    if path is None:
        return
    found = {kind_id: {"why": why, "code": _code()}}
    remote = remote_store()
    if remote is not None:
        remote.publish_in_pieces(COMPILE_CACHE.environment(device_type).env_id, found)
    _save(path, found, "which kinds compile only in pieces")
