"""Numbers read from the pack's environment variables, one way for all: unset gives the default; a value that is
not a number is logged with the variable's name and the default is used (a typo in a server's environment must
never stop a prompt, and must not pass unseen)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("comfyui_accel")


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        log.warning("[Accel] %s=%r is not a number; using %s", name, raw, default)
        return default
