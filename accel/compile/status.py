"""Where one compiled model or VAE stands, in a few words a user can read on its node: compiling in the prompt's path
(the prompt waits), compiling in the background (k of n kinds), loading from the cache, compiled (with the speedup
the whole-call check, or for a VAE the per-call timing, measured), eager (and why), or still checking.

Compile Model's and Compile VAE's callers name an owner (the web UI's node id) when they apply them; the owner's
model (or compiled VAE) is kept by a weak reference, so a model ComfyUI frees is simply no longer reported.
Nothing here changes what runs.
"""
from __future__ import annotations

import statistics
import threading
import weakref
from collections import Counter
from typing import Callable

from .. import dynamic_vram
from .background.state import BackgroundState
from .model_record import records_of

MODEL, VAE = "compile_model", "compile_vae"  # the features that name owners, as the web UI knows them
# owner -> (feature, its base model or VAE, choose, for a VAE: how to list its compiled methods)
_owners: "dict[str, tuple[str, weakref.ref, str, Callable | None]]" = {}
# owner -> its model's block calls since the owner applied Compile Model: {"compiled": n, "eager": {reason: n}}
_calls: "dict[str, dict]" = {}
_lock = threading.Lock()


def note_owner(owner: str | None, target, feature: str = MODEL, choose: str = "auto",
               methods_of: Callable | None = None) -> None:
    """`owner` applied `feature` with `choose` to `target`: Compile Model to a base model
    (comfy.model_base.BaseModel), Compile VAE to the compiled copy of a VAE, whose (method name, registry entry)
    pairs `methods_of(target)` gives (the newest application wins)."""
    if owner is None:
        return
    with _lock:
        _owners[str(owner)] = (feature, weakref.ref(target), choose, methods_of)
        _calls.pop(str(owner), None)


def note_calls(owner: str | None, last_call: dict) -> list[str]:
    """Add one model call's block calls (model_record's `last_call`: compiled, eager by reason) to `owner`'s, so
    its status says how this node's calls ran, apart from other nodes' models that share its kinds. Returns the
    eager reasons this owner meets for the first time."""
    if not last_call:
        return []
    with _lock:  # a model compiled with no owner (in-process use) counts under None: its lines come once too
        tally = _calls.setdefault(None if owner is None else str(owner), {"compiled": 0, "eager": Counter()})
        new = [reason for reason, n in last_call.get("eager", {}).items() if n and reason not in tally["eager"]]
        tally["compiled"] += last_call.get("compiled", 0)
        tally["eager"].update(last_call.get("eager", {}))
        return new


def owner_calls(owner: str) -> dict:
    with _lock:
        tally = _calls.get(str(owner), {"compiled": 0, "eager": Counter()})
        return {"compiled": tally["compiled"], "eager": dict(tally["eager"])}


def owner_statuses() -> dict[str, dict]:
    """The status of every owner whose model is alive, with its "feature"."""
    with _lock:
        owners = list(_owners.items())
    statuses = {}
    for owner, (feature, ref, choose, methods_of) in owners:
        target = ref()
        if target is None:
            with _lock:
                if owner in _owners and _owners[owner][1] is ref:
                    del _owners[owner]
            continue
        status = model_status(target, choose) if feature == MODEL else vae_status(methods_of(target))
        statuses[owner] = {"feature": feature, **with_placement(status, target)}
        if feature == MODEL:
            statuses[owner]["calls"] = owner_calls(owner)
    return statuses


def with_placement(status: dict, target) -> dict:
    """`status` with which way its model (or VAE copy) runs as to dynamic VRAM, where that was in play
    (accel/dynamic_vram.py): one that could not leave it is eager whatever else its records say."""
    placement = dynamic_vram.placement_of(target)
    if placement is None:
        return status
    if placement.eager:
        return {**status, "state": "eager", "text": placement.text, "dynamic_vram": "kept"}
    return {**status, "text": f"{status['text']}; {placement.text}",
            "dynamic_vram": "kept" if placement.kept else "left"}


def _compiling_in_path(entries) -> list:
    return [e for e in entries if e.compiling_now]


def _ready(entries) -> list:
    """Kinds that ran compiled at least once (compiled, or loaded from the cache)."""
    return [e for e in entries if e.ran_compiled and not e.compiling_now]


def _in_background(entries) -> list:
    return [e for e in entries if e.background.state in (BackgroundState.CAPTURED, BackgroundState.PENDING)
            or e.background.compiling_new_shape]


def _loading(entries) -> list:
    return [e for e in entries if e.background.state is BackgroundState.AWAITING_CPU_CHECKS]


def model_status(base_model, choose: str = "auto") -> dict:
    """{"state": waiting | compiling | loading | checking | compiled | eager, "text": one line, "kinds": ...} of
    `base_model` compiled with `choose`. Clones share the base model: only the records of that choice count (a
    record has auto mode's state exactly when its choose is auto)."""
    records = [r for r in records_of(base_model) if (r.auto is not None) == (choose == "auto")]
    if not records:
        return {"state": "waiting", "text": "compiles at the first sampling step", "kinds": [],
                "progress": {"done": 0, "total": 0, "kinds": []}}
    entries = list({e.name: e for record in records for e in record.entries}.values())

    def path(entry) -> str:  # always compiled: every kind, whatever auto mode chose for it elsewhere
        return entry.path if choose == "auto" or entry.failure else "compiled"

    kinds = [{"kind": e.kind.label, "path": path(e), "reason": e.reason or e.background.reason,
              "background": e.background.stats()["state"]} for e in entries]
    n = len(entries)
    compiling = _in_background(entries)
    loading = _loading(entries)
    compiled = [e for e in entries if path(e) == "compiled"]
    autos = [r.auto for r in records if r.auto is not None]
    now = _compiling_in_path(entries)
    progress = {"done": len(_ready(entries)), "total": n, "kinds": [e.kind.label for e in entries]}
    if now:
        state, text = "compiling", (f"compiling (or loading) {now[0].kind.label} in the prompt's path; the prompt "
                                    f"waits for it. {progress['done']} of {n} kinds compiled so far")
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
        text += _evidence(autos, entries)
    elif autos and any(a.verdict is None for a in autos):
        state, text = "checking", f"{len(compiled)} of {n} kinds compiled; timing whole steps compiled vs eager"
    elif compiled:
        eager, compiled_s = _timed_calls(autos)
        state, text = "compiled", f"{len(compiled)} of {n} kinds compiled" + (
            f", whole steps {statistics.median(eager) / statistics.median(compiled_s):.2f}x eager's speed "
            "(medians)" if eager and compiled_s else "") + _evidence(autos, entries)
    else:
        state, text = "eager", "eager: no block kind was worth compiling"
    return {"state": state, "text": text + _graphs_text(records, entries), "kinds": kinds, "progress": progress}


def _graphs_text(records, entries) -> str:
    """With cuda_graphs asked for: whether the blocks replay CUDA graphs, and why not (cuda_graphs.py)."""
    from .cuda_graphs import check_of, status_line
    from .policy import device_policy

    wanted = [r for r in records if r.options.cuda_graphs]
    if not wanted or not entries:
        return ""
    device = entries[0].device_type
    policy = device_policy(device)
    return "; " + status_line(True, device, policy.allows("cuda_graphs"), policy.explain("cuda_graphs"),
                              check_of(wanted[0]))


def vae_status(methods: list[tuple[str, object]]) -> dict:
    """{"state": ..., "text": ...} of a VAE copy made by Compile VAE, from its (coding method, registry entry) pairs:
    per method it has run (decode, encode), where that method's compiled kind stands. A VAE has no whole-call
    check: auto mode keeps the faster of compiled and eager timed on the VAE's own calls (kind_choice.py), so that
    is the speedup shown."""
    methods = [(method, entry) for method, entry in methods if entry is not None]
    entries = [entry for _, entry in methods]
    progress = {"done": len(_ready(entries)), "total": len(entries), "kinds": [e.kind.label for e in entries]}
    if not methods:
        return {"state": "waiting", "text": "compiles at the first decode (or encode)", "progress": progress}
    now = [method for method, entry in methods if entry in _compiling_in_path(entries)]
    if now:
        return {"state": "compiling", "progress": progress,
                "text": f"compiling (or loading) the VAE's {now[0]} in the prompt's path; the prompt waits for it"}
    compiling = [method for method, entry in methods if entry in _in_background(entries)]
    if compiling:
        return {"state": "compiling", "progress": progress,
                "text": f"{' and '.join(compiling)} compiling in the background; the VAE runs eagerly meanwhile"}
    loading = [method for method, entry in methods if entry in _loading(entries)]
    if loading:
        return {"state": "loading", "progress": progress,
                "text": f"{' and '.join(loading)} found in the compile cache, loaded once inductor's CPU checks "
                        "are done; eager meanwhile"}
    parts, states = [], []
    for method, entry in methods:
        state, text = _vae_method_status(entry)
        states.append(state)
        parts.append(f"{method} {text}")
    state = next(s for s in ("checking", "compiled", "eager") if s in states)
    return {"state": state, "text": "; ".join(parts), "progress": progress}


def _vae_method_status(entry) -> tuple[str, str]:
    if entry.failure:
        return "eager", f"eager: {entry.failure}"
    if entry.options.choose == "always compiled":
        return "compiled", "compiled (choose: always compiled)"
    choice = entry.choice
    if not choice.decided:
        return "checking", f"compiled; {choice.progress() or 'timing compiled against eager'}"
    if choice.path == "eager":
        return "eager", f"eager: {choice.reason}"
    timings = choice.timings
    speedup = f", {timings['eager_s'] / timings['compiled_s']:.2f}x eager's speed" if timings else ""
    return "compiled", f"compiled{speedup} ({choice.reason})"


def _evidence(autos, entries) -> str:
    """What a verdict was taken on: clean samples only, how many were dropped beside the pack's own work, and
    whether a close call will be checked again (auto_mode.py)."""
    dropped = sum(a.dropped.total for a in autos) + sum(e.choice.dropped.total for e in entries)
    text = "; on clean samples" + (f" ({dropped} taken beside the pack's own work dropped)" if dropped else "")
    if any(a.close_call and a.recheck_left for a in autos):
        text += "; a close call, checked again in a few runs"
    return text


def _timed_calls(autos) -> tuple[list[float], list[float]]:
    """The seconds of the whole eager and compiled calls the check timed. Read while the sampler may add to them:
    list() copies a dict's values or a list in one step under the GIL."""
    by_paths = [by_path for a in autos for by_path in list(a.samples.values())]
    return ([s for by_path in by_paths for s in list(by_path.get("eager", []))],
            [s for by_path in by_paths for s in list(by_path.get("compiled", []))])
