"""What the hardware policy means for one Compile Model call: compile or not, in which mode, with which
attention. Decided once per device and set of ACCEL_DISABLE_* switches; each fallback is logged once."""
from __future__ import annotations

import dataclasses
import logging
import os

from .. import hardware
from .options import CompileOptions

log = logging.getLogger("comfyui_accel")
_policies: dict[tuple, hardware.Policy] = {}
_warned: set[tuple] = set()

# A mode needs a feature; without it, the mode compiles as "default".
MODE_NEEDS = {"reduce-overhead": "cuda_graphs", "max-autotune-no-cudagraphs": "max_autotune"}


def device_policy(device) -> hardware.Policy:
    key = (str(device), tuple(os.environ.get(s, "") for s in hardware.SWITCHES.values()))
    policy = _policies.get(key)
    if policy is None:
        policy = _policies[key] = hardware.decide(hardware.probe(device))
        log.info("[Accel] hardware policy for %s: %s", device,
                 ", ".join(f"{f}={'on' if d.allowed else 'off'}" for f, d in policy.decisions.items()))
    return policy


def warn_once(device, feature: str, message: str) -> None:
    if (str(device), feature, message) not in _warned:
        _warned.add((str(device), feature, message))
        log.warning("[Accel] Compile Model: %s", message)


def effective_options(options: CompileOptions, policy: hardware.Policy, device) -> CompileOptions:
    feature = MODE_NEEDS.get(options.mode)
    if feature and not policy.allows(feature):
        warn_once(device, feature, f"mode {options.mode} is not available here, compiling in default mode: "
                                   f"{policy.explain(feature)}")
        return dataclasses.replace(options, mode="default")
    return options
