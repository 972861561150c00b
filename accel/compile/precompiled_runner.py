"""A block kind's calls served by the graphs a child saved whole (`KindEntry.precompiled_calls`): loading the kind's
due precompiled functions (at an idle moment, background/loader.py, or at a call that may compile anyway) and a
call served by one whose guards accept its inputs, without Dynamo. The functions themselves and their guards are
precompiled.py's `PrecompiledGraphs` (`KindEntry.precompiled`); what the kind counts stays on its `KindEntry`."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..cache import COMPILE_CACHE
from .background.cpu_checks import CPU_CHECKS
from .dynamo_runner import layouts_of
from .precompiled import NO_GRAPH, loadable, unavailable
from .shapes import CompiledCall

if TYPE_CHECKING:
    from .kinds import KindEntry

log = logging.getLogger("comfyui_accel")


class PrecompiledRunner:
    """The kind's precompiled path: loading what is due, and serving a call."""

    def __init__(self, entry: KindEntry):
        self.entry = entry
        self._noted: set = set()  # the signatures it served, noted in the kind's shapes (KindShapes.note_served)

    def look_up_before_a_compile(self) -> None:
        """Before the kind's first compile in this process: if the persistent cache (or the fleet's store behind
        it) holds precompiled functions of its key, a child or another process saved it whole (one compile path,
        issue #71: choose="always compiled", background=false), so they are due and the call loads them instead of
        tracing. Asked once per kind; a kind the background decision looked at already knows (decision.py)."""
        entry = self.entry
        graphs = entry.precompiled
        graphs.looked_up = True
        if graphs.expected or unavailable():
            return
        env = COMPILE_CACHE.environment(entry.device_type)
        graphs.due = env.check_usable() and env.has_precompiled(entry.cache_id, loadable)

    def load(self, before_a_compile: bool = False) -> bool:
        """Load the kind's due precompiled functions (precompiled.py) now: at an idle moment (background/loader.py)
        or at its next call, whichever comes first. False when they cannot load yet: on the CPU before inductor's
        per-process checks ran (loading would run them here: seconds), unless `before_a_compile` (a call that
        compiles here otherwise, which runs the same checks): then they run now, and the kind loads."""
        entry = self.entry
        with entry.call_lock:
            graphs = entry.precompiled
            if not graphs.due:
                return True
            if entry.device_type == "cpu" and not CPU_CHECKS.done:
                if not before_a_compile:
                    return False
                CPU_CHECKS.want(hold=False)
                CPU_CHECKS.wait()
            loaded = len(graphs.loaded_names)
            env = COMPILE_CACHE.environment(entry.device_type)
            with env.loading():
                graphs.load_due(lambda: env.precompiled_files(entry.cache_id), env.inductor_dir)
            if len(graphs.loaded_names) != loaded:
                log.info("[Accel] Compile Model: %s loaded %d precompiled graphs (%.2f s in all so far)",
                         entry.kind.label, len(graphs.loaded_names) - loaded, graphs.load_seconds)
            return True

    def call(self, block, call: CompiledCall, may_load: bool):
        """The call served by a precompiled function of the kind; NO_GRAPH when none accepts the inputs. With
        `may_load` (a call that may compile anyway) it loads those still due first; without, they load between
        prompts (background/loader.py) and inputs only they would serve get NO_GRAPH meanwhile."""
        entry = self.entry
        graphs = entry.precompiled
        loads_now = may_load and graphs.due and self.load(before_a_compile=True) and not graphs.due
        if not graphs.functions:
            return NO_GRAPH
        return self._serve(block, call, warm=not loads_now)  # a call that loaded: no fair timing

    def _serve(self, block, call: CompiledCall, warm: bool):
        entry = self.entry
        call_args, call_kwargs = call.args, call.kwargs
        # what a child compiling a new shape of the kind replays first: taken before the block may change them
        layouts = layouts_of(call_args, call_kwargs) if entry.first_call is None else None
        out = entry.precompiled.serve(block, entry.forward, call_args, call_kwargs, entry.kind.label)
        if out is NO_GRAPH:
            return out
        entry.first_call = entry.first_call or layouts
        if call.signature not in self._noted:  # the kind's shapes need each signature once
            self._noted.add(call.signature)
            entry.shapes.note_served(call_args, call_kwargs)
        entry.cache_hits += 1
        entry.last_call_warm = warm  # a call that loaded is no fair timing
        return out
