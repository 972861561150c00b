"""Process-wide record of what the pack did to which model, for the log, the demo and GET /accel/stats.

Kept deliberately small: a list of events and per-feature counters behind one lock, because nodes run
on ComfyUI's executor thread while the HTTP route reads from the server's event loop.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

_lock = threading.Lock()
_events: list[dict[str, Any]] = []
_counters: Counter[str] = Counter()
MAX_EVENTS = 1000  # a long-running server must not grow without bound


def record(feature: str, action: str, **details: Any) -> dict[str, Any]:
    """Note that `feature` (e.g. "compile_model") did `action` (e.g. "applied"), with JSON-able details."""
    event = {"time": time.time(), "feature": feature, "action": action, **details}
    with _lock:
        _events.append(event)
        del _events[:-MAX_EVENTS]
        _counters[f"{feature}.{action}"] += 1
    return event


def snapshot() -> dict[str, Any]:
    with _lock:
        return {"counters": dict(_counters), "events": list(_events)}


def reset() -> None:
    with _lock:
        _events.clear()
        _counters.clear()
