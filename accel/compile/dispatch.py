"""Per block (and per VAE coding call, vae.py), running the route its kind was given for the call (routes.py,
decided by auto_mode.plan_call before the call; the VAE's by vae.py).

For the length of one apply_model call every repeated block gets an instance-level `forward`, a
`BlockDispatcher`. It binds its route's runner when it is installed: the route is final for the call, and no
runner decides it again. What depends on the call's inputs is answered in one place each: whether this block call
may run compiled (the site's `compiled_call`: another node's patch, or its compiled call's inputs), whether its
weights are all on the compute device (answered once, at the install), and for a compiled kind whether its graphs
serve the inputs (a new shape, a guard they refuse), which the runner acts on: eager while a child compiles that
graph (to_child.py), or compiled here. Each block runs exactly once per call, on the call's own inputs: timing wraps
the real call, capturing reads its inputs' layouts only.
"""
from __future__ import annotations

import functools
import time

from .background import ACTIVITY
from .cuda_graphs import graphs_of
from .dynamo_runner import WOULD_COMPILE
from .kinds import KindEntry, wait_for_device
from .registry import REGISTRY
from .routes import CallPlan, Route
from .shapes import CompiledCall, compiled_call, tensor_shapes
from .to_child import ToChild

LOADS_BETWEEN_PROMPTS = "compiled, loads between prompts"
TIMING_EAGER_SIDE = "timing: the eager side of the per-kind choice"
NEW_SHAPE_IN_BACKGROUND = "a new input shape compiling in the background"


def timed(run, into: dict, key, device_type: str):
    """`run()`, its seconds added to `into[key]` (waiting for the device's queued work before and after)."""
    wait_for_device(device_type)
    start = time.perf_counter()
    out = run()
    wait_for_device(device_type)
    into[key] = into.get(key, 0.0) + time.perf_counter() - start
    return out


class BlockDispatcher:
    """A block's `forward` for the length of one call: its route's runner, bound once.

    `site` is the block's (blocks.BlockSite) or a VAE coding method's (vae.CodingSite): its module, the attribute
    that runs, and `compiled_call(args, kwargs, block_options)`, the per-call answer. `eager_reason`: why this block
    runs eagerly in the whole call (weights not all on the compute device), or None."""

    def __init__(self, site, entry: KindEntry, plan: CallPlan, eager_reason: str | None = None, progress=None):
        self.site, self.entry, self.plan = site, entry, plan
        self.eager_reason, self.progress = eager_reason, progress
        self.run = getattr(self, RUNNERS[plan.routes[entry.key]])

    @functools.cached_property
    def to_child(self) -> ToChild:
        """What of its calls goes to a child (to_child.py), made when one first might: a warm call never does."""
        return ToChild(self.site, self.entry, self.plan)

    def __call__(self, *args, **kwargs):
        self.plan.blocks += 1
        return self.run(args, kwargs)

    # -- the routes' runners (RUNNERS) --------------------------------------------------------------
    def _plain(self, args: tuple, kwargs: dict):
        """ComfyUI's own forward, uncounted (a whole-call eager sample)."""
        return self.entry.forward(self.site.module, *args, **kwargs)

    def _profile(self, args: tuple, kwargs: dict):
        """ComfyUI's own forward, timed for the kind's share of the call; a kind going to a child is captured."""
        plan, entry = self.plan, self.entry
        if entry.key in plan.to_background and not self.eager_reason:
            self.to_child.cold_call(args, kwargs)
        return timed(lambda: entry.forward(self.site.module, *args, **kwargs), plan.kind_seconds, entry.key,
                     plan.device_type)

    def _background(self, args: tuple, kwargs: dict):
        """Eager for the whole call while a child compiles the kind (or it waits for inductor's CPU checks, which
        may end during the call: its blocks compile or load from the next call on)."""
        if self.eager_reason:
            return self._eager(args, kwargs, self.eager_reason)
        return self._eager(args, kwargs, self.to_child.cold_call(args, kwargs))

    def _loading(self, args: tuple, kwargs: dict):
        """Eager until the kind's precompiled graphs load, between prompts."""
        self.plan.graphs_missing = True
        return self._eager(args, kwargs, LOADS_BETWEEN_PROMPTS)

    def _compiled_route(self, args: tuple, kwargs: dict):
        """choose="always compiled": compiled, compiling here what is missing."""
        return self._with_compiled_call(args, kwargs, lambda call: self._compiled(call, args, kwargs))

    def _chosen(self, args: tuple, kwargs: dict):
        """The kind's chosen path (timed while undecided); its compiled side may compile here."""
        return self._with_compiled_call(args, kwargs, lambda call: self._on_chosen_path(
            args, kwargs, lambda: self._compiled(call, args, kwargs)))

    def _chosen_off_prompt(self, args: tuple, kwargs: dict):
        """The kind's chosen path; inputs its graphs do not serve run eagerly while a child compiles their graph.
        Dynamo's own guards say what a graph serves once the kind has graphs of one frame each
        (`can_refuse_compiles`); a kind with graph breaks has the kind's shapes predict it (`would_compile`)."""
        return self._with_compiled_call(args, kwargs, lambda call: self._off_prompt(call, args, kwargs))

    def _off_prompt(self, call: CompiledCall, args: tuple, kwargs: dict):
        if self.entry.can_refuse_compiles:
            return self._on_chosen_path(args, kwargs, lambda: self._compiled_or_eager(call, args, kwargs))
        if self.plan.new_shapes_in_background and self.to_child.predicted_new_shape(call):
            self.plan.graphs_missing = True
            return self._eager(args, kwargs, NEW_SHAPE_IN_BACKGROUND)
        return self._on_chosen_path(args, kwargs, lambda: self._compiled(call, args, kwargs))

    # -- what the runners share ---------------------------------------------------------------------
    def _with_compiled_call(self, args: tuple, kwargs: dict, then):
        """The compiled routes' common start: the block eagerly where this call's answer says so (its weights,
        another node's patch), else replayed from a CUDA graph where the call graphs the kind, else `then(call)`
        with its compiled call (shapes.CompiledCall)."""
        call = self._compiled_call(args, kwargs)
        if isinstance(call, str):
            return self._eager(args, kwargs, call)
        out = self._graphed(call, args, kwargs)
        return then(call) if out is WOULD_COMPILE else out

    def _compiled_call(self, args: tuple, kwargs: dict) -> CompiledCall | str:
        """This call's compiled call, or why the block runs eagerly (its weights, another node's patch)."""
        if self.eager_reason:
            return self.eager_reason
        return self.site.compiled_call(args, kwargs, self.plan.block_options)

    def _eager(self, args: tuple, kwargs: dict, reason: str):
        return self.entry.run_eager(self.site.module, args, kwargs, reason)

    def _compiled(self, call: CompiledCall, args: tuple, kwargs: dict):
        entry = self.entry
        before = entry.compiles
        out = entry.run_compiled(self.site.module, call, args, kwargs)
        if entry.compiles > before:  # it compiled here
            if before == 0 and self.progress is not None:
                self.progress.update(1)
            if self.plan.saves_compiled:
                self.to_child.compiled_here(call, first=before == 0)
        return out

    def _on_chosen_path(self, args: tuple, kwargs: dict, run_compiled):
        """choose="auto": run the block on its kind's chosen path; while the kind is undecided, this real call is
        one timed sample of the choice (kind_choice.py), on the side whose turn it is for calls of its input
        shape. A sample beside the pack's own work (background/activity.py) is dropped."""
        entry, device_type = self.entry, self.plan.device_type
        choice = entry.choice
        if choice.path == "compiled":
            return run_compiled()
        if choice.path == "eager" or entry.failure:
            return self._eager(args, kwargs, entry.reason)
        shape = tensor_shapes(args, kwargs)
        side, seconds, window = choice.next_side(shape), {}, ACTIVITY.window()
        if side == "compiled":
            out = timed(run_compiled, seconds, side, device_type)
            if not entry.last_call_warm:  # it compiled or met new inputs: no fair sample
                return out
        else:
            out = timed(lambda: self._eager(args, kwargs, TIMING_EAGER_SIDE), seconds, side, device_type)
        competing = window.competing()
        if competing:
            choice.drop(competing)
        else:
            choice.record(shape, side, seconds[side])
        return out

    def _graphed(self, call: CompiledCall, args: tuple, kwargs: dict):
        """The compiled call replayed from a CUDA graph once warm (cuda_graphs.BlockGraphs, opt-in), where the call
        graphs the kind; WOULD_COMPILE when it does not, or the kind's graphs do not serve the inputs (the route then
        does what it does without CUDA graphs)."""
        entry, block, graphs = self.entry, self.site.module, self.plan.graphs
        if graphs is None or entry.key not in graphs.kinds or not entry.can_refuse_compiles:
            return WOULD_COMPILE
        return graphs_of(entry).run(block, call.args, call.kwargs, lambda a, k: entry.run_compiled(
            block, compiled_call(a, k, lambda: (a, k)), args, kwargs, may_compile=False))

    def _compiled_or_eager(self, call: CompiledCall, args: tuple, kwargs: dict):
        """A compiled kind's call that must not compile in the prompt (choose=auto with a background compile):
        the kind's graphs serve it, as Dynamo's own guards say, or it runs eagerly on its untouched inputs and a
        child compiles its graph (`ToChild.refused_new_shape`). A new size, batch (a batch of 1 against one of 2), cfg 1
        dropping the uncond half or a longer prompt: each is a guard, none is predicted."""
        out = self.entry.run_compiled(self.site.module, call, args, kwargs, may_compile=False)
        if out is not WOULD_COMPILE:
            return out
        if not self.to_child.refused_new_shape(call):
            return self._compiled(call, args, kwargs)  # nothing else would make or load its graph
        self.plan.graphs_missing = True
        return self._eager(args, kwargs, NEW_SHAPE_IN_BACKGROUND)


# Each route's runner: what a dispatcher binds at its install (the route is final for the call).
RUNNERS = {Route.PLAIN: "_plain", Route.PROFILE: "_profile", Route.BACKGROUND: "_background",
           Route.LOADING: "_loading", Route.COMPILED: "_compiled_route", Route.CHOSEN: "_chosen",
           Route.CHOSEN_OFF_PROMPT: "_chosen_off_prompt"}
assert set(RUNNERS) == set(Route), "every route has its runner"


class RecordingDispatcher(BlockDispatcher):
    """A BlockDispatcher that also records each compiled call's layouts, for `python -m accel precompile` only (in
    its own process: REGISTRY.record_compiled_calls), which saves each kind whole from them after. The patcher
    picks the class once per model call (`dispatcher_class`): a block call on the normal path never asks whether
    precompile records."""

    def _compiled(self, call: CompiledCall, args: tuple, kwargs: dict):
        self.to_child.capture(call, into=REGISTRY.recorded)  # the call's layouts, for saving the kind whole after
        return super()._compiled(call, args, kwargs)


def dispatcher_class() -> type[BlockDispatcher]:
    """The class of the dispatchers a model call's blocks get, read once per call before its blocks run:
    RecordingDispatcher while precompile records (REGISTRY.recorded set), else BlockDispatcher."""
    return BlockDispatcher if REGISTRY.recorded is None else RecordingDispatcher
