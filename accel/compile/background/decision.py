"""Whether a kind's first cold compile goes to a background child, decided once per kind at its first compiled
call (state.py's UNDECIDED), and what happens instead when it does not."""
from __future__ import annotations

from ...cache import COMPILE_CACHE
from ..precompiled import loadable as precompiled_loadable, unavailable as precompile_unavailable
from .cpu_checks import CPU_CHECKS
from .idle_gate import hold_until_idle
from .loader import LOADER


def decide_background(entry) -> bool:
    """Whether `entry`'s (kinds.KindEntry) first cold compile goes to a child: True when it must be compiled cold
    (never compiled here, no path chosen, no artifacts of its key in the persistent cache). Otherwise it also
    moves the kind's background state to what happens instead: not needed (compiled here, or found in the cache:
    those load in a fraction of a compile), or waiting for inductor's CPU checks before it loads."""
    if not entry.background.undecided:
        return False
    if entry.compiles or entry.shapes.seen_inputs or entry.choice.decided or entry.failure:
        entry.background.not_needed("compiled in this process")
        return False
    env = COMPILE_CACHE.environment(entry.device_type)
    if not env.check_usable():
        entry.background.not_needed("no usable compile cache to hand graphs over")
        return False
    if not precompile_unavailable():
        # Precompiled functions load in milliseconds; without them (a cache older than them: torch's caches
        # only) a child makes them, mostly from those caches, while the blocks run eagerly.
        if not env.has_precompiled(entry.cache_id, precompiled_loadable):
            return True
        entry.precompiled.due = True
        LOADER.load_when_idle([entry])  # at the next idle moment (on the CPU once the checks ran), or next call
        if entry.device_type == "cpu" and CPU_CHECKS.wait_for_them(entry.background, hold_until_idle("cpu")):
            return False
        entry.background.not_needed("found precompiled in the persistent compile cache")
        return False
    if env.has_artifacts(entry.cache_id):
        # on the CPU, loading waits for inductor's per-process checks, run off the prompt's path first
        if entry.device_type == "cpu" and CPU_CHECKS.wait_for_them(entry.background, hold_until_idle("cpu")):
            return False
        entry.background.not_needed("found in the persistent compile cache")
        return False
    return True
