"""Hardware probe and the policy it implies: which optimisations this device may use, each with a reason.

Older GPUs crash on optimisations built for newer ones, so every risky optimisation is decided here, once, from
what the device is and has, and each has an environment switch that turns it off (`ACCEL_DISABLE_<NAME>=1`).
The policy is a pure function of a probe, so it is tested over a table of simulated devices.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from .env_settings import env_switch

# Each switch turns one optimisation off; the log names the switch whenever a feature falls back.
SWITCHES = {
    "compile": "ACCEL_DISABLE_COMPILE",
    "cuda_graphs": "ACCEL_DISABLE_CUDA_GRAPHS",
    "max_autotune": "ACCEL_DISABLE_MAX_AUTOTUNE",
    "sdpa_in_compiled_blocks": "ACCEL_DISABLE_SDPA_IN_COMPILED_BLOCKS",
    "background_compile": "ACCEL_DISABLE_BACKGROUND_COMPILE",
}


@dataclass(frozen=True)
class DeviceProbe:
    device_type: str  # "cuda", "cpu", "mps", "xpu"
    name: str = ""
    capability: tuple[int, int] | None = None  # CUDA compute capability
    triton: bool = False
    c_compiler: bool = False
    cuda_malloc_async: bool = False


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str


@dataclass(frozen=True)
class Policy:
    probe: DeviceProbe
    decisions: dict[str, Decision] = field(default_factory=dict)

    def allows(self, feature: str) -> bool:
        return self.decisions[feature].allowed

    def explain(self, feature: str) -> str:
        return self.decisions[feature].reason


def probe(device=None) -> DeviceProbe:
    """The real probe of `device` (default: ComfyUI's torch device when ComfyUI is loaded, else CPU)."""
    import importlib.util

    import torch

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    c_compiler = any(shutil.which(cc) for cc in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if cc)
    if device.type == "cuda":
        allocator = torch.cuda.get_allocator_backend() if hasattr(torch.cuda, "get_allocator_backend") else ""
        return DeviceProbe("cuda", torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                           importlib.util.find_spec("triton") is not None,
                           c_compiler, allocator == "cudaMallocAsync")
    return DeviceProbe(device.type, device.type, None, False, c_compiler, False)


def decide(found: DeviceProbe, env: dict[str, str] | None = None) -> Policy:
    env = os.environ if env is None else env
    decisions: dict[str, Decision] = {}
    for feature, rule in _RULES.items():
        switch = SWITCHES[feature]
        value = env_switch(switch, env)
        if value is not None:
            decisions[feature] = Decision(False, f"turned off by {switch}={value}")
        else:
            allowed, reason = rule(found, decisions)
            decisions[feature] = Decision(allowed, reason if allowed else f"{reason} (set {switch}=1 to silence)")
    return Policy(found, decisions)


def _compile(p: DeviceProbe, _):
    if p.device_type == "cuda":
        if not p.triton:
            return False, "inductor needs Triton on CUDA and it is not installed"
        if p.capability and p.capability < (7, 0):
            return False, f"Triton needs compute capability 7.0+, {p.name} is sm_{p.capability[0]}{p.capability[1]}"
        return True, f"inductor with Triton on {p.name}"
    if p.device_type == "cpu":
        if not p.c_compiler:
            return False, "inductor on the CPU needs a C++ compiler (g++ or clang++) and none was found"
        return True, "inductor C++ backend on the CPU"
    return False, f"inductor is not supported on {p.device_type} by this pack yet"


def _cuda_graphs(p: DeviceProbe, decided):
    if not decided["compile"].allowed or p.device_type != "cuda":
        return False, "CUDA graphs need CUDA and a compiled model"
    if p.cuda_malloc_async:
        return False, ("CUDA graph trees do not work with the cudaMallocAsync allocator that ComfyUI enables by "
                       "default; start ComfyUI with --disable-cuda-malloc to use reduce-overhead")
    return True, "CUDA graphs available"


def _max_autotune(p: DeviceProbe, decided):
    if not decided["compile"].allowed:
        return False, "nothing is compiled"
    if p.device_type == "cuda" and p.capability and p.capability < (8, 0):
        return False, (f"max-autotune's Triton GEMM templates need tensor cores of sm_80+; "
                       f"{p.name} is sm_{p.capability[0]}{p.capability[1]}")
    return True, "autotuning allowed"


def _sdpa_in_compiled_blocks(p: DeviceProbe, decided):
    return decided["compile"].allowed, "PyTorch SDPA replaces graph-breaking attention inside compiled blocks"


def _background_compile(p: DeviceProbe, decided):
    if not decided["compile"].allowed:
        return False, "nothing is compiled"
    # A child process of its own: on CUDA it opens a second CUDA context (its VRAM cost is not measured yet).
    return True, "cold compiles run in a child process while blocks run eagerly"


_RULES = {"compile": _compile, "cuda_graphs": _cuda_graphs, "max_autotune": _max_autotune,
          "sdpa_in_compiled_blocks": _sdpa_in_compiled_blocks, "background_compile": _background_compile}
