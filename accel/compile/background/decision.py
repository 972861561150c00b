"""Whether a kind's first cold compile goes to a background child, decided once per kind at its first compiled
call (state.py's UNDECIDED), and what happens instead when it does not.

`decide_background` only looks (the kind, the persistent cache) and says what to do; `carry_out` does it, when
the call's plan is made (routes.CallPlan.fill_routes), before any block runs. `saves_compiled` says whether what
compiles in ComfyUI's process in a call goes to a child to be saved whole (one compile path, issue #71)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...env_settings import OFF_VALUES

from ...cache import COMPILE_CACHE
from ..precompiled import loadable as precompiled_loadable, unavailable as precompile_unavailable
from .cpu_checks import CPU_CHECKS
from .idle_gate import hold_until_idle
from .loader import LOADER

SAVE_ENV = "ACCEL_SAVE_COMPILES"  # on unless set to an off value: graphs compiled in ComfyUI's process are saved


@dataclass(frozen=True)
class BackgroundStep:
    """What an undecided kind does about its first compile."""
    send: bool = False  # compile it in a child: its first block's inputs are captured in this call
    load_precompiled: bool = False  # a child's precompiled functions are in the cache: load them when idle
    after_cpu_checks: bool = False  # on the CPU, its blocks run eagerly until inductor's checks ran (cpu_checks.py)
    not_needed: str = ""  # else why it compiles, or loads, in this process


def decide_background(entry) -> BackgroundStep | None:
    """What `entry`'s (kinds.KindEntry) first cold compile needs, or None when its background state is decided
    already. A child compiles it when it must be compiled cold: never compiled here, no path chosen, no artifacts
    of its key in the persistent cache. Otherwise it is not needed: compiled here, or found in the cache (those
    load in a fraction of a compile), on the CPU once inductor's checks ran. Changes nothing."""
    if not entry.background.undecided:
        return None
    if entry.compiles or entry.shapes.seen_inputs or entry.choice.decided or entry.failure:
        return BackgroundStep(not_needed="compiled in this process")
    env = COMPILE_CACHE.environment(entry.device_type)
    if not env.check_usable():
        return BackgroundStep(not_needed="no usable compile cache to hand graphs over")
    on_cpu = entry.device_type == "cpu"
    if not precompile_unavailable():
        # Precompiled functions load in milliseconds; without them (a cache older than them: torch's caches
        # only) a child makes them, mostly from those caches, while the blocks run eagerly.
        if not env.has_precompiled(entry.cache_id, precompiled_loadable):
            return BackgroundStep(send=True)
        return BackgroundStep(load_precompiled=True, after_cpu_checks=on_cpu,
                              not_needed="found precompiled in the persistent compile cache")
    if env.has_artifacts(entry.cache_id):
        # on the CPU, loading waits for inductor's per-process checks, run off the prompt's path first
        return BackgroundStep(after_cpu_checks=on_cpu, not_needed="found in the persistent compile cache")
    return BackgroundStep(send=True)


def saves_compiled(options, policy_allows_a_child: bool, precompile_records: bool) -> bool:
    """Whether graphs compiled in ComfyUI's process with these options (options.CompileOptions) are saved whole by a
    child after the call, as a child saves what it compiles: where the hardware policy lets a child run
    (ACCEL_DISABLE_BACKGROUND_COMPILE), the options allow one (`mode=low-memory` promises no extra process; a whole
    model is never sent to one), torch can save them (precompiled.unavailable) and ACCEL_SAVE_COMPILES is not
    off. Never in `python -m accel precompile`'s own process (`precompile_records`: registry.REGISTRY.recorded is
    set), which saves each kind whole itself."""
    if not (policy_allows_a_child and options.may_use_a_child) or precompile_records:
        return False
    if precompile_unavailable():
        return False
    return os.environ.get(SAVE_ENV, "").strip().lower() not in OFF_VALUES[1:]


def carry_out(entry, step: BackgroundStep) -> bool:
    """Do `step` for `entry`; True when its blocks wait in this call: captured for a child, or until inductor's CPU
    checks ran (those may have finished since the step was decided: then it loads now)."""
    if step.send:
        return True
    if step.load_precompiled:
        entry.precompiled.due = True
        LOADER.load_when_idle([entry])  # at the next idle moment (on the CPU once the checks ran), or next call
    if step.after_cpu_checks and CPU_CHECKS.wait_for_them(entry.background, hold_until_idle("cpu")):
        return True
    entry.background.not_needed(step.not_needed)
    return False
