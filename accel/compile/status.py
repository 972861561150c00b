"""Where one compiled model stands, in a few words a user can read on its node: compiling in the prompt's path (the
prompt waits), compiling in the background (k of n kinds), loading from the cache, compiled (with the speedup the
whole-call check measured), eager (and why), or still checking.

Compile Model's callers name an owner (the web UI's node id) when they apply it; the owner's model is kept by a
weak reference, so a model ComfyUI frees is simply no longer reported. Nothing here changes what runs.
"""
from __future__ import annotations

import statistics
import threading
import weakref

from .background.state import BackgroundState
from .model_record import records_of

_owners: "dict[str, weakref.ref]" = {}  # owner -> the base model (comfy.model_base.BaseModel) compiled for it
_lock = threading.Lock()


def note_owner(owner: str | None, base_model) -> None:
    """`owner` applied Compile Model to `base_model` (the newest application wins)."""
    if owner is None:
        return
    with _lock:
        _owners[str(owner)] = weakref.ref(base_model)


def owner_statuses() -> dict[str, dict]:
    """The status of every owner whose model is alive."""
    with _lock:
        owners = list(_owners.items())
    statuses = {}
    for owner, ref in owners:
        base_model = ref()
        if base_model is None:
            with _lock:
                if _owners.get(owner) is ref:
                    del _owners[owner]
            continue
        statuses[owner] = model_status(base_model)
    return statuses


def model_status(base_model) -> dict:
    """{"state": waiting | compiling | loading | checking | compiled | eager, "text": one line, "kinds": ...}."""
    records = records_of(base_model)
    if not records:
        return {"state": "waiting", "text": "compiles at the first sampling step", "kinds": []}
    entries = list({e.name: e for record in records for e in record.entries}.values())
    kinds = [{"kind": e.kind.label, "path": e.path, "reason": e.reason or e.background.reason,
              "background": e.background.stats()["state"]} for e in entries]
    n = len(entries)
    compiling = [e for e in entries if e.background.state in (BackgroundState.CAPTURED, BackgroundState.PENDING)
                 or e.background.compiling_new_shape]
    loading = [e for e in entries if e.background.state is BackgroundState.AWAITING_CPU_CHECKS]
    compiled = [e for e in entries if e.path == "compiled"]
    autos = [r.auto for r in records if r.auto is not None]
    now = [e for e in entries if e.compiling_now]
    if now:
        state, text = "compiling", (f"compiling (or loading) {now[0].kind.label} in the prompt's path; the prompt "
                                    f"waits for it. {len(compiled)} of {n} kinds compiled so far")
    elif compiling:
        state, text = "compiling", (f"compiling in the background: {n - len(compiling)} of {n} kinds ready; "
                                    "the blocks run eagerly meanwhile")
    elif loading:
        state, text = "loading", (f"{len(loading)} of {n} kinds found in the compile cache, loaded once inductor's "
                                  "CPU checks are done; the blocks run eagerly meanwhile")
    elif autos and all(a.verdict == "eager" for a in autos):
        eager, compiled_s = _timed_calls(autos)
        # The check keeps compiled blocks only if their slowest whole step beats eager's fastest (auto_mode.py):
        # those are the numbers to show, not medians, which may favour compiled by less than the noise.
        state, text = "eager", (
            f"eager: compiled whole steps were not faster in every comparison (slowest compiled "
            f"{max(compiled_s):.3f} s vs fastest eager {min(eager):.3f} s)" if eager and compiled_s
            else "eager: " + autos[0].reason.split(":")[0])  # no kind was worth compiling or faster compiled
    elif autos and any(a.verdict is None for a in autos):
        state, text = "checking", f"{len(compiled)} of {n} kinds compiled; timing whole steps compiled vs eager"
    elif compiled:
        eager, compiled_s = _timed_calls(autos)
        state, text = "compiled", f"{len(compiled)} of {n} kinds compiled" + (
            f", whole steps {statistics.median(eager) / statistics.median(compiled_s):.2f}x eager's speed "
            "(medians)" if eager and compiled_s else "")
    else:
        state, text = "eager", "eager: no block kind was worth compiling"
    return {"state": state, "text": text, "kinds": kinds}


def _timed_calls(autos) -> tuple[list[float], list[float]]:
    """The seconds of the whole eager and compiled calls the check timed. Read while the sampler may add to them:
    list() copies a dict's values or a list in one step under the GIL."""
    by_paths = [by_path for a in autos for by_path in list(a.samples.values())]
    return ([s for by_path in by_paths for s in list(by_path.get("eager", []))],
            [s for by_path in by_paths for s in list(by_path.get("compiled", []))])
