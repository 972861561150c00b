"""The pack's malloc tune (ACCEL_MALLOC_TUNE): large CPU allocations reuse heap memory instead of fresh pages.

When Compile Model is first applied (never at import), on Linux with glibc, it raises glibc's mmap threshold to
32 MiB (the highest its own dynamic threshold reaches), the trim threshold to 256 MiB and the top pad to 64 MiB
(a whole heap of a thread's arena). On the 2-core CPU this took a frozen-threshold process from 617 faults per
2.5 MB `cat` to 0 and kept a thread's outputs in its own arena when its heap was filled near its end
(tests/test_process_tax.py). It never lowers a value and changes no result; its cost is memory: free heap
memory up to those sizes stays mapped (RSS) instead of going back to the system.

It stays off where it could only guess or interfere: the switch off, not Linux glibc, glibc's parameters not
readable (glibc.py), the user set `MALLOC_*` or `GLIBC_TUNABLES` (they tune malloc themselves; tests/test_soak.py
freezes the threshold on purpose), or another allocator (tcmalloc, jemalloc, mimalloc) is preloaded or mapped.

Opt-in for now (ACCEL_MALLOC_TUNE=1): on the CPU none of the pack's own steps brought the faults back, and the
GPU run that would show this is the H200's cause (bench/process_tax.py --malloc-diag) has not been made.
"""
from __future__ import annotations

import logging
import os
import threading

from ..env_settings import OFF_VALUES
from .allocators import alternative_allocator, serves_malloc
from .glibc import M_MMAP_THRESHOLD, M_TOP_PAD, M_TRIM_THRESHOLD, glibc_version, libc, params

log = logging.getLogger("comfyui_accel")

SWITCH = "ACCEL_MALLOC_TUNE"
DEFAULT_ON = False  # provisional: opt-in until a GPU run confirms the cause (docs/process_tax.md)
NOT_GLIBCS = "the process's malloc is not glibc's"
TARGETS = {"mmap_threshold": (M_MMAP_THRESHOLD, 32 << 20), "trim_threshold": (M_TRIM_THRESHOLD, 256 << 20),
           "top_pad": (M_TOP_PAD, 64 << 20)}


def switch_on(env=None) -> bool:
    raw = (os.environ if env is None else env).get(SWITCH, "").strip().lower()
    return DEFAULT_ON if not raw else raw not in OFF_VALUES


def user_settings(env=None) -> list[str]:
    """The environment variables by which the user tunes glibc malloc already. A MALLOC_ variable counts even
    empty: glibc 2.36 read MALLOC_TOP_PAD_= as a top pad of 0 and froze the thresholds."""
    env = os.environ if env is None else env
    return sorted(name for name, value in env.items()
                  if name.startswith("MALLOC_") or (name == "GLIBC_TUNABLES" and value.strip()))


def reason_not_to_tune(env=None) -> str | None:
    """Why the tune stays off in this process, or None when it may be applied."""
    if not switch_on(env):
        return f"{SWITCH} is off" + ("" if DEFAULT_ON else f" by default; {SWITCH}=1 turns it on")
    if glibc_version() is None or libc() is None:
        return "the C library is not glibc on Linux"
    settings = user_settings(env)
    if settings:
        return f"the environment tunes malloc already ({', '.join(settings)})"
    other = alternative_allocator()
    if serves_malloc(other):
        names = other["preloaded"] + [p for p in other["mapped"] if p not in other["preloaded"]]
        return f"another allocator serves malloc ({', '.join(names) or NOT_GLIBCS})"
    if not params():
        return "glibc's malloc parameters could not be read (so they could not be checked)"
    return None


class MallocTune:
    """Applied at most once per process; re-checked after loads (recheck) in case a library lowered it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._decided = False
        self.state: dict = {"switch": SWITCH, "applied": False, "why_not": None, "before": {}, "after": {}}

    def apply_once(self) -> dict:
        with self._lock:
            if self._decided:
                return self.state
            self._decided = True
            why_not = reason_not_to_tune()
            if why_not:
                self.state["why_not"] = why_not
                log.debug("[Accel] malloc tune not applied: %s", why_not)
                return self.state
            before = params()
            raised = self._raise(before)
            self.state.update(applied=True, before=before, after=params(), raised=raised)
            log.info("[Accel] %s: glibc malloc's mmap threshold %s, trim threshold %s, top pad %s (was %s, %s, %s): "
                     "large CPU tensors reuse heap memory instead of faulting in fresh pages; %s=0 turns this off "
                     "(docs/process_tax.md)", SWITCH, *(_mib(self.state["after"].get(k)) for k in TARGETS),
                     *(_mib(before.get(k)) for k in TARGETS), SWITCH)
            return self.state

    def recheck(self) -> list[str]:
        """After the pack's loads: if the tune was applied and a value is now below it (a library called mallopt),
        raise it again and say which mapped libraries import mallopt. The names raised again."""
        with self._lock:
            if not self.state["applied"]:
                return []
            now = params()
            low = [name for name, (_, target) in TARGETS.items() if now and now[name] < target]
            if not low:
                return []
            self._raise(now)
        from .importers import malloc_importers

        who = [path for path, names in malloc_importers().items() if "mallopt" in names]
        log.warning("[Accel] %s: glibc's %s went below the tune (%s); raised again. Libraries that import mallopt: "
                    "%s", SWITCH, ", ".join(low), ", ".join(f"{k} {_mib(now[k])}" for k in low),
                    ", ".join(who) or "none mapped")
        return low

    @staticmethod
    def _raise(current: dict) -> list[str]:
        raised = []
        for name, (option, target) in TARGETS.items():
            if current.get(name, 0) < target and libc().mallopt(option, target) == 1:
                raised.append(name)
        return raised


def _mib(value) -> str:
    return "?" if value is None else f"{value / (1 << 20):g} MiB"


TUNE = MallocTune()


def ensure_tuned() -> dict:
    """Compile Model's hook: the tune decided (and applied where it may be) once per process. Never raises."""
    try:
        return TUNE.apply_once()
    except Exception as err:  # noqa: BLE001  (a diagnostic's failure never costs a prompt)
        log.warning("[Accel] %s: could not be applied (%s); malloc keeps its settings", SWITCH, err)
        return TUNE.state
