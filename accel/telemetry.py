"""Process-wide record of what the pack did to which model, for the log, the demo and GET /accel/stats.

Kept deliberately small: a list of events and per-feature counters behind one lock, because nodes run
on ComfyUI's executor thread while the HTTP route reads from the server's event loop.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable

_lock = threading.Lock()
_events: list[dict[str, Any]] = []
_counters: Counter[str] = Counter()
_listeners: list[Callable[[dict[str, Any]], None]] = []
MAX_EVENTS = 1000  # a long-running server must not grow without bound
log = logging.getLogger("comfyui_accel")


def record(feature: str, action: str, **details: Any) -> dict[str, Any]:
    """Note that `feature` (e.g. "compile_model") did `action` (e.g. "applied"), with JSON-able details."""
    event = {"time": time.time(), "feature": feature, "action": action, **details}
    with _lock:
        _events.append(event)
        del _events[:-MAX_EVENTS]
        _counters[f"{feature}.{action}"] += 1
        listeners = list(_listeners)
    for listener in listeners:  # outside the lock: a listener may read snapshot()
        try:
            listener(event)
        except Exception as err:  # the web UI's status is never worth a prompt
            log.warning("[Accel] a status listener failed on %s.%s: %s", feature, action, err)
    return event


def subscribe(listener: Callable[[dict[str, Any]], None]) -> None:
    """Call `listener(event)` after each record (from the thread that recorded it). Subscribing twice is once."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def unsubscribe(listener: Callable[[dict[str, Any]], None]) -> None:
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)


def snapshot() -> dict[str, Any]:
    with _lock:
        return {"counters": dict(_counters), "events": list(_events)}


def reset() -> None:
    with _lock:
        _events.clear()
        _counters.clear()
