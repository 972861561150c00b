"""Per block, running the route its kind was given for the call (routes.py, decided by auto_mode.plan_call).

For the length of one apply_model call every repeated block gets an instance-level `forward`, a
`BlockDispatcher`, that runs it through its kind's registry entry on that route. What depends on the block or
the call's inputs is settled here, in `BlockDispatcher.__call__`: a block whose weights are offloaded or whose
call another node patched runs eagerly, a kind sent to a child has its first block captured, and a call whose
inputs no graph of the kind serves runs eagerly while a child compiles that graph. Each block runs exactly once
per call, on the call's own inputs: timing wraps the real call, capturing reads its inputs' layouts only.
"""
from __future__ import annotations

import time

from .attention import compiled_block_options
from .background import ACTIVITY, Capture
from .blocks import PATCHED, BlockSite, attention_swapped, block_patch_reason, whole_model_safe_options
from .cuda_graphs import graphs_of
from .dynamo_runner import WOULD_COMPILE
from .kinds import KindEntry, wait_for_device
from .registry import REGISTRY
from .routes import CallPlan, Route
from .shapes import input_signature, steady_unit_strides, tensor_shapes

IN_BACKGROUND = "compiling in the background"
LOADS_BETWEEN_PROMPTS = "compiled, loads between prompts"
TIMING_EAGER_SIDE = "timing: the eager side of the per-kind choice"
NEW_SHAPE_IN_BACKGROUND = "a new input shape compiling in the background"


def run_on_chosen_path(entry: KindEntry, block, args: tuple, kwargs: dict, device_type: str, run_compiled):
    """choose="auto": run the block on its kind's chosen path; while the kind is undecided, this real call is
    one timed sample of the choice (kind_choice.py), on the side whose turn it is for calls of its input shape.
    A sample beside the pack's own work (background/activity.py) is dropped."""
    choice = entry.choice
    if choice.path == "compiled":
        return run_compiled()
    if choice.path == "eager" or entry.failure:
        return entry.run_eager(block, args, kwargs, entry.reason)
    shape = tensor_shapes(args, kwargs)
    side, seconds, window = choice.next_side(shape), {}, ACTIVITY.window()
    if side == "compiled":
        out = timed(run_compiled, seconds, side, device_type)
        if not entry.last_call_warm:  # it compiled or met new inputs: no fair sample
            return out
    else:
        out = timed(lambda: entry.run_eager(block, args, kwargs, TIMING_EAGER_SIDE), seconds, side, device_type)
    competing = window.competing()
    if competing:
        choice.drop(competing)
    else:
        choice.record(shape, side, seconds[side])
    return out


def new_shape_goes_to_child(entry: KindEntry, block, attribute: str, make_call, captures: dict) -> bool:
    """A call's inputs need a graph the compiled kind does not have. True when the call runs eagerly because a
    child compiles that graph (captured now into `captures`, by kind key, which the caller sends when its call
    ends; or a child is already on the kind) or saved it and this process loads it between prompts (loader.py); False
    when nothing else will: the kind compiles it here, as before background compiles (a child failed on it)."""
    background = entry.background
    call_args, call_kwargs = make_call()
    signature = input_signature(call_args, call_kwargs)
    if signature in entry.shapes.shapes_sent:
        return background.compiling_new_shape or entry.precompiled.due
    capture = captures.get(entry.key)
    if capture is not None and capture.new_shape:  # another new shape in this call: the same child
        capture.add_call(signature, call_args, call_kwargs)
        entry.shapes.shapes_sent.add(signature)
        return True
    if background.compiling_new_shape:
        return True  # a child works on this kind: these inputs go to the next one, from a later call
    if not background.may_compile_new_shape or (entry.first_call is None and not entry.precompiled.expected):
        return False
    # the kind's first call's layouts first, so the child makes the same static-then-dynamic graphs this process
    # would (none yet: a restarted process whose precompiled graphs do not serve its first call)
    capture = captures[entry.key] = Capture.in_this_call(entry, block, attribute, new_shape=True,
                                                         calls=[entry.first_call] if entry.first_call else [])
    capture.add_call(signature, call_args, call_kwargs)
    entry.shapes.shapes_sent.add(signature)
    background.new_shape()
    return True


def timed(run, into: dict, key, device_type: str):
    """`run()`, its seconds added to `into[key]` (waiting for the device's queued work before and after)."""
    wait_for_device(device_type)
    start = time.perf_counter()
    out = run()
    wait_for_device(device_type)
    into[key] = into.get(key, 0.0) + time.perf_counter() - start
    return out


class BlockDispatcher:
    """A block's `forward` for the length of one apply_model call."""

    def __init__(self, site: BlockSite, entry: KindEntry, plan: CallPlan, allow_sdpa: bool,
                 eager_reason: str | None, progress):
        self.site, self.entry, self.plan, self.allow_sdpa = site, entry, plan, allow_sdpa
        self.eager_reason, self.progress = eager_reason, progress
        self.patched_reason: str | None = None  # why the latest _make_call gave None, where it is not PATCHED

    def __call__(self, *args, **kwargs):
        plan, entry, block = self.plan, self.entry, self.site.module
        plan.blocks += 1
        route = plan.routes[entry.key]
        if route is Route.BACKGROUND and not (entry.background.waiting or entry.background.undecided):
            route = plan.reroute(entry)
        if route is Route.PLAIN:  # ComfyUI's own forward, uncounted
            return entry.forward(block, *args, **kwargs)
        waits = entry.key in plan.to_background and not self.eager_reason and self._send_to_background(args, kwargs)
        if route is Route.PROFILE:
            return self._timed(lambda: entry.forward(block, *args, **kwargs), plan.kind_seconds, entry.key)
        if waits:
            return entry.run_eager(block, args, kwargs, IN_BACKGROUND)
        if route is Route.LOADING:
            plan.graphs_missing = True
            return entry.run_eager(block, args, kwargs, LOADS_BETWEEN_PROMPTS)
        if self.eager_reason:  # this block's weights are not all on the compute device (a partial load)
            return entry.run_eager(block, args, kwargs, self.eager_reason)
        make_call = self._make_call(args, kwargs)
        if make_call is None:  # or the call is patched (also a BACKGROUND route's block that could not be captured)
            return entry.run_eager(block, args, kwargs, self.patched_reason or PATCHED)
        if plan.graphs is not None and entry.key in plan.graphs.kinds and entry.can_refuse_compiles:
            out = self._graphed(make_call, args, kwargs)  # CUDA graphs (opt-in): inputs its graphs serve
            if out is not WOULD_COMPILE:
                return out
        if route is Route.COMPILED:
            return self._compiled(make_call, args, kwargs)
        if route is Route.CHOSEN_OFF_PROMPT:
            if entry.can_refuse_compiles:
                return run_on_chosen_path(entry, block, args, kwargs, plan.device_type,
                                          lambda: self._compiled_or_eager(make_call, args, kwargs))
            if plan.new_shapes_in_background and self._new_shape_in_background(make_call):  # graph breaks
                plan.graphs_missing = True
                return entry.run_eager(block, args, kwargs, NEW_SHAPE_IN_BACKGROUND)
        return run_on_chosen_path(entry, block, args, kwargs, plan.device_type,
                                  lambda: self._compiled(make_call, args, kwargs))

    def _timed(self, run, into: dict, key):
        return timed(run, into, key, self.plan.device_type)

    def _compiled(self, make_call, args: tuple, kwargs: dict):
        entry = self.entry
        first_compile = entry.compiles == 0
        out = entry.run_compiled(self.site.module, make_call, args, kwargs)
        if first_compile and entry.compiles and self.progress is not None:
            self.progress.update(1)
        return out

    def _graphed(self, make_call, args: tuple, kwargs: dict):
        """The compiled call replayed from a CUDA graph once warm (cuda_graphs.BlockGraphs); WOULD_COMPILE when
        the kind's graphs do not serve the inputs (the route then does what it does without graphs)."""
        entry, block = self.entry, self.site.module
        call_args, call_kwargs = make_call()
        return graphs_of(entry).run(block, call_args, call_kwargs, lambda a, k: entry.run_compiled(
            block, lambda: (a, k), args, kwargs, may_compile=False))

    def _compiled_or_eager(self, make_call, args: tuple, kwargs: dict):
        """A compiled kind's call that must not compile in the prompt (choose=auto with a background compile):
        the kind's graphs serve it, as Dynamo's own guards say, or it runs eagerly on its untouched inputs and a
        child compiles its graph (`new_shape_goes_to_child`). A new size, batch (a batch of 1 against one of 2),
        cfg 1 dropping the uncond half or a longer prompt: each is a guard, none is predicted (the VAE's calls
        the same way: vae.py)."""
        entry = self.entry
        out = entry.run_compiled(self.site.module, make_call, args, kwargs, may_compile=False)
        if out is not WOULD_COMPILE:
            return out
        if not new_shape_goes_to_child(entry, self.site.module, self.site.attribute, make_call, self.plan.captures):
            return self._compiled(make_call, args, kwargs)  # nothing else would make or load its graph
        self.plan.graphs_missing = True
        return entry.run_eager(self.site.module, args, kwargs, NEW_SHAPE_IN_BACKGROUND)

    def _make_call(self, args: tuple, kwargs: dict):
        """A function building fresh (args, kwargs) for a compiled call of this block, or None when this call
        must run eagerly (another node patched what the block computes, in the call's options or by swapping
        ComfyUI's attention function); `patched_reason` then says why where it is not PATCHED."""
        self.patched_reason = None
        if attention_swapped():
            return None
        options, with_options = self.site.options_of_call(args, kwargs)
        if with_options is None:
            return lambda: steady_unit_strides(args, kwargs)
        options = options or {}
        if self.site.whole_model:
            safe = whole_model_safe_options(options)
        else:
            self.patched_reason = block_patch_reason(options)
            safe = None if self.patched_reason else {}
        if safe is None:
            return None
        # fresh each call: blocks write into their transformer_options
        return lambda: steady_unit_strides(*with_options({**safe, **compiled_block_options(self.allow_sdpa)}))

    def _new_shape_in_background(self, make_call) -> bool:
        """For a kind with graph breaks (no `can_refuse_compiles`): True when this call of a compiled kind runs
        eagerly because its inputs' shape would compile a new graph, as `would_compile` predicts: the call is
        captured and a child compiles that graph, as it does a kind's first one. Shapes already compiled keep
        running compiled meanwhile."""
        entry, plan = self.entry, self.plan
        background = entry.background
        if entry.choice.path != "compiled" or entry.failure or not (
                background.compiling_new_shape or background.may_compile_new_shape):
            return False
        call_args, call_kwargs = make_call()
        signature = input_signature(call_args, call_kwargs)
        capture = plan.captures.get(entry.key)
        if background.compiling_new_shape:
            if capture is not None and capture.new_shape:  # another new shape in this call: the same child
                capture.add_call(signature, call_args, call_kwargs)
                entry.shapes.shapes_sent.add(signature)
            return signature not in entry.shapes.seen_inputs
        if entry.first_call is None or not entry.shapes.would_compile(call_args, call_kwargs):
            return False
        capture = plan.captures[entry.key] = Capture.in_this_call(entry, self.site.module, self.site.attribute,
                                                                  calls=[entry.first_call], new_shape=True)
        capture.add_call(signature, call_args, call_kwargs)
        entry.shapes.shapes_sent.add(signature)
        background.new_shape()
        return True

    def _send_to_background(self, args: tuple, kwargs: dict) -> bool:
        """For a kind the plan sends to a child (`to_background`): True when this block runs eagerly because its
        kind compiles in the background. The first block of a kind that must be compiled cold is captured (its
        inputs' layouts) for the child process."""
        plan, entry = self.plan, self.entry
        capture = plan.captures.get(entry.key)
        if capture is None and not entry.background.undecided:  # a child has it, or it settled since the plan
            return entry.background.waiting
        make_call = self._make_call(args, kwargs)
        if make_call is None:  # patched in this call: capture a later block of the kind
            return entry.background.waiting
        if capture is None:
            capture = plan.captures[entry.key] = Capture.in_this_call(entry, self.site.module, self.site.attribute)
            entry.background.capture()
        call_args, call_kwargs = make_call()
        capture.add_call(input_signature(call_args, call_kwargs), call_args, call_kwargs)
        return True


class RecordingDispatcher(BlockDispatcher):
    """A BlockDispatcher that also records each compiled call's layouts, for `python -m accel precompile` only (in
    its own process: REGISTRY.record_compiled_calls), which saves each kind whole from them after. The patcher
    picks the class once per model call (`dispatcher_class`): a block call on the normal path never asks whether
    precompile records."""

    def _compiled(self, make_call, args: tuple, kwargs: dict):
        self._record(make_call)  # the call's layouts, for saving the kind whole after
        return super()._compiled(make_call, args, kwargs)

    def _record(self, make_call) -> None:
        entry = self.entry
        capture = REGISTRY.recorded.get(entry.key)
        if capture is None:
            capture = REGISTRY.recorded[entry.key] = Capture.in_this_call(entry, self.site.module, self.site.attribute)
        call_args, call_kwargs = make_call()
        capture.add_call(input_signature(call_args, call_kwargs), call_args, call_kwargs)


def dispatcher_class() -> type[BlockDispatcher]:
    """The class of the dispatchers a model call's blocks get, read once per call before its blocks run:
    RecordingDispatcher while precompile records (REGISTRY.recorded set), else BlockDispatcher."""
    return BlockDispatcher if REGISTRY.recorded is None else RecordingDispatcher
