"""The C allocator's part of `python -m accel doctor` (and of GET /accel/stats): what glibc malloc is set to now,
who could change it, and warnings for the states that give a large CPU tensor fresh pages on every call."""
from __future__ import annotations

import os

from .allocators import alternative_allocator, mapped_alternatives, preloaded_alternatives, serves_malloc
from .glibc import glibc_version, mallinfo2, params
from .importers import malloc_importers
from .tune import TUNE, user_settings

FROZEN_BELOW = 4 << 20  # a sampler's CPU tensors are 1-3 MB (cond_cat): a frozen threshold below this mmaps them


def settings() -> dict:
    """Cheap enough for every stats request: the live parameters, glibc's totals and the pack's tune."""
    return {"glibc": glibc_version(), "params": params(), "mallinfo2": mallinfo2(), "tune": dict(TUNE.state)}


def malloc_report(pid: int | None = None, env: dict | None = None) -> dict:
    """This process's allocator state, or (pid, with env its environment as /proc shows it) another process's:
    there glibc's live parameters cannot be read (they live in its memory), only what it maps and started with."""
    own = pid is None or pid == os.getpid()
    env = dict(os.environ) if own or env is None else env
    if own:
        found = {**settings(), "allocator": alternative_allocator()}
    else:
        mapped = mapped_alternatives(pid)
        found = {"glibc": glibc_version(), "params": None, "mallinfo2": None, "tune": None,
                 "allocator": {"mapped": mapped, "preloaded": preloaded_alternatives(env), "malloc_is_glibcs": None}}
    found["environment"] = {name: env[name] for name in user_settings(env) + ["LD_PRELOAD"] if name in env}
    found["importers"] = malloc_importers("self" if own else pid)
    found["warnings"] = malloc_problems(found)
    return found


def malloc_problems(found: dict) -> list[str]:
    said = []
    if serves_malloc(found["allocator"]):
        return said  # glibc's settings do not matter then; the report says which allocator serves
    mp = found["params"]
    if found["glibc"] and mp == {}:
        said.append("glibc's malloc settings could not be read in place (unknown, not fine): the checks of "
                    "frozen and low thresholds were skipped")
    if mp:
        if not mp["dynamic"] and mp["mmap_threshold"] < FROZEN_BELOW:
            said.append(f"glibc's mmap threshold is frozen at {_size(mp['mmap_threshold'])} (a mallopt or a "
                        "MALLOC_*_ variable): every CPU tensor above it, such as ComfyUI's 1-3 MB conditioning "
                        "each step, gets fresh pages and faults them all in on every call (docs/process_tax.md: "
                        "unset the MALLOC_*_ variable that set it, or ACCEL_MALLOC_TUNE=1 raises it)")
        if mp["trim_threshold"] < mp["mmap_threshold"] + mp["top_pad"]:
            said.append(f"glibc's trim threshold ({_size(mp['trim_threshold'])}) is below the mmap threshold plus "
                        f"the top pad ({_size(mp['mmap_threshold'] + mp['top_pad'])}): a large CPU tensor freed "
                        "at the heap's top is given back and faulted in again at the next call")
    for path, names in (found.get("importers") or {}).items():
        said.append(f"{path} imports {' and '.join(names)}: it can "
                    + ("freeze glibc's thresholds" if "mallopt" in names else "")
                    + (" and " if len(names) > 1 else "")
                    + ("give free heap pages back, so they fault again" if "malloc_trim" in names else "")
                    + " (harmless unless it is called: compare the settings before and after it loads)")
    return said


def _size(value: int) -> str:
    return f"{value / (1 << 20):.3g} MiB" if value >= 1 << 20 else f"{value // 1024} KiB"
