"""The pack's environment variables, read one way for all. Numbers: unset gives the default; a value that is not a
finite number (inf only where a setting takes it) is logged with the variable's name and the default is used (a
typo in a server's environment must never stop a prompt, and must not pass unseen). Switches (ACCEL_DISABLE_*): on
for any value but unset, empty, 0, false, no or off, in any case (a docker-compose file's `false` turned a switch
on)."""
from __future__ import annotations

import logging
import math
import os

log = logging.getLogger("comfyui_accel")


def env_float(name: str, default: float, allow_inf: bool = False) -> float:
    """The variable's number; with `allow_inf`, `inf` too (a size with no cap)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        log.warning("[Accel] %s=%r is not a number; using %s", name, raw, default)
        return default
    if math.isfinite(value) or (allow_inf and value == math.inf):
        return value
    log.warning("[Accel] %s=%r is not a finite number; using %s", name, raw, default)
    return default


OFF_VALUES = ("", "0", "false", "no", "off")


def env_switch(name: str, env=None) -> str | None:
    """The switch's value when it is on (for a message to quote), else None."""
    raw = (os.environ if env is None else env).get(name, "").strip()
    return None if raw.lower() in OFF_VALUES else raw

