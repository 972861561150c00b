"""One captured kind compiled in the child and saved whole: a job item (background/capture.py,
`Capture.job_item`) compiled for each of its calls' layouts through an entry of a registry of the child's own, then
each layout's graph saved as a precompiled function (saving.py), with its twin for larger batches where it needs one
(batch_twin.py). Run per item by the child's loop (serve.py), and by `python -m accel precompile` as its last step
(accel/precompile.py), each in a process of its own.
"""
from __future__ import annotations

import logging
import time

import torch
import torch._dynamo

from ..background.skeleton import load_skeleton
from .batch_twin import batch_of, batch_twin

log = logging.getLogger("comfyui_accel")


def compile_item(item: dict, registry) -> dict:
    """Compile one captured kind (a job item, capture.Capture.job_item) for each of its calls' layouts, in their
    order, through an entry of `registry`, then save its graphs whole; what happened, as results.json lists it.
    Also `python -m accel precompile`'s last step, in its own process (accel/precompile.py)."""
    from ..blocks import BlockKind
    from ..options import CompileOptions
    from ..shapes import CompiledCall, input_signature

    block = load_skeleton(item["block"])
    entry = registry.entry(BlockKind(*item["kind"]), getattr(type(block), item["attribute"]),
                           CompileOptions(**item["options"]), torch.device(item["device"]))
    # a new shape of a kind the parent runs: the dimensions it already made dynamic stay so here
    entry.shapes.dynamic_dims.update(tuple(d) for d in item.get("dynamic_dims", ()))
    start = time.perf_counter()
    marks = []  # per call, the dimensions its compiled call marked dynamic
    batches = set()  # the calls' batches (batch_twin.batch_of)
    # A graph break raises at once (Dynamo's error_on_graph_break) instead of compiling the kind as several graphs:
    # those could not be saved whole, and the parent runs such a kind eagerly (kind_choice.compiles_only_in_pieces),
    # so compiling them was wasted (Wan's VAE encode: 29 graphs, 105 s of a child here, 2026-11-27).
    with torch.inference_mode(item["inference"]), torch.set_grad_enabled(item["grad"]), \
            torch._dynamo.error_on_graph_break(True):
        for call in item["calls"]:
            args, kwargs = load_skeleton(call)
            batches.add(batch_of(args, kwargs))
            entry.run_compiled(block, CompiledCall(args, kwargs, input_signature(args, kwargs),
                                                   lambda: (args, kwargs)), args, kwargs)  # noqa: B023
            marks.append(set(entry.shapes.dynamic_dims))
            if entry.failure:
                break
    # a graph break, not a failure
    in_pieces = entry.failed_with is not None and issubclass(entry.failed_with, torch._dynamo.exc.Unsupported)
    failure = None if in_pieces else entry.failure
    with torch.inference_mode(item["inference"]), torch.set_grad_enabled(item["grad"]):
        compiled_seconds = time.perf_counter() - start
        precompiled, torch_refused = (None, False) if entry.failure else save_precompiled(
            entry, block, item["calls"], marks, batches, {"grad": item["grad"], "inference": item["inference"]})
    if in_pieces:
        precompiled = entry.failure.removeprefix("compile failed: ")  # why: what Dynamo could not trace whole
    result = {"cache_id": entry.cache_id, "kind": entry.kind.label, "failure": failure,
              "seconds": round(time.perf_counter() - start, 2), "compiles": entry.compiles,
              "fx_graph_misses": entry.disk_cache.get("fx_graph_misses", 0), "precompiled": precompiled,
              "precompile_refused": torch_refused, "graph_breaks": entry.graph_breaks or in_pieces}
    log.info("[Accel] compiled %s in %.1f s (precompiled: %s in %.1f s)%s", entry.kind.label,
             compiled_seconds, precompiled, result["seconds"] - compiled_seconds,
             f" (failed: {entry.failure})" if entry.failure else "")
    return result


def save_precompiled(entry, block, calls: list[bytes], marks: list[set], batches: set,
                     modes: dict) -> tuple[int | str, bool]:
    """Save the kind's graph for each call's layouts as a precompiled function (saving.py; this process's side
    loads it: compile/precompiled.py), after the compiled calls above (its graphs then come from torch's caches
    they filled), under the grad and inference modes of the captured call (`modes`, kept in each file: its guards
    are rebuilt under them when loaded); beside a dynamic graph made at a batch of 1, its twin for larger batches
    (batch_twin.py, given the calls' `batches`), compiled here. Returns the number saved, or why none, and whether
    torch refused a graph (it raised while saving or loading one back: a block that does not compile whole, or what
    ComfyUI 0.33's dtype records did before saving.LOAD_RECORD_SUFFIX); then the kind loads the old way in
    ComfyUI's process, which the parent warns of (background/state.py). Precompiling switched off or missing from
    torch is no refusal."""
    from ...cache import COMPILE_CACHE
    from .. import precompiled
    from ..dynamo_runner import compile_kwargs
    from ..entry_function import entry_point
    from ..shapes import input_signature
    from . import saving

    why = precompiled.unavailable()
    if why:
        return why, False
    env = COMPILE_CACHE.environment(entry.device_type)
    if not env.check_usable():
        return f"no usable compile cache ({env.problem})", False
    to_compile = entry_point(entry.forward, entry.name)
    kwargs_for_compile = compile_kwargs(entry.options, entry.device_type)
    saved, done = 0, set()

    def save(args: tuple, kwargs: dict, dims: set) -> None:
        """One precompiled function for these inputs, unless saved already; raises what torch raises."""
        nonlocal saved
        key = (input_signature(args, kwargs), tuple(sorted(dims)))
        if key in done:
            return
        done.add(key)
        context = precompiled.context_of(block, entry.forward, args, kwargs)
        name = saving.file_name(context, key)
        with env.compiling(entry.cache_id, entry.name):  # torch's caches: the graphs compiled above (not a twin's)
            function = saving.precompile(to_compile, kwargs_for_compile, block, args, kwargs, dims)
        with env.loading():
            payload, layout = saving.pack(function, saving.kernels_of(function, env.inductor_dir))
        env.save_precompiled(entry.cache_id, name, payload, entry.kind.label,
                             {"name": name, "format": precompiled.FORMAT, "context": context, **modes, **layout})
        saved += 1

    for call, dims in zip(calls, marks):
        try:
            save(*load_skeleton(call), dims)  # fresh tensors: the calls above may have changed theirs in place
        except Exception as err:  # noqa: BLE001  (the kind still has its graphs in torch's caches)
            why = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
            log.info("[Accel] background compile: %s cannot be precompiled (%s)", entry.kind.label, why)
            return why, True
        twin = batch_twin(block, *load_skeleton(call), dims, batches)
        if twin is not None:
            try:
                save(*twin, dims)
            except Exception as err:  # noqa: BLE001  (a batch change then needs a job, as without the twin)
                log.info("[Accel] background compile: %s has no graph for larger batches (%s: %s)",
                         entry.kind.label, type(err).__name__, str(err).strip()[:200])
    return saved, False
