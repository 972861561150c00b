"""What every Accel node shares: its category and the pass-through used until a feature's engine lands."""
from __future__ import annotations

import logging

from ..accel import telemetry

CATEGORY = "Accel"
log = logging.getLogger("comfyui_accel")


def pass_through(feature: str, display_name: str, obj, **options):
    """Return `obj` unchanged (a clone for a ModelPatcher, so the input stays the user's own) and say so."""
    out = obj.clone() if hasattr(obj, "clone") else obj
    telemetry.record(feature, "passed_through", options=options)
    log.info("[Accel] %s: pass-through in this version (options %s); the model runs as it is.", display_name, options)
    return out
