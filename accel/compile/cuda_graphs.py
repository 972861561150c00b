"""CUDA graphs over compiled block calls (CompileOptions.cuda_graphs, opt-in): which kinds may replay a captured
graph in a call (`plan_kind`, a pure function of what the call knows), whether whole steps are faster with them
(`GraphCheck`, choose="auto"), and the capture and replay themselves (`BlockGraphs`, CUDA only).

A Flux step at batch 1-2 is partly launch-bound on a GPU (gpu_h100.md: kernels 11.9 ms of a 16.2 ms step); a
graph replays a block's kernels with one launch. What breaks a replay, and what this module does about it
(docs/cuda_graphs.md has the reasoning):
- weights that move (lowvram, offload): such a block already runs eagerly (dispatch's `eager_reason`), and a
  partially loaded model replays nothing; its blocks run their plain compiled graphs.
- weights that change (LoRA strength, Swap Weights, dynamic VRAM): ComfyUI puts new Parameters in place, so the
  weights' addresses are part of a graph's key; a new address records a new graph, counted, and a kind that
  records more than MAX_RECORDINGS runs its plain compiled graph from then on.
- DeepCache's shallow steps call fewer blocks: graphs are per block, so a shallow step replays the ones it calls.
- a graph's outputs live in its memory pool and are overwritten by its next replay (DeepCache keeps a full step's
  features for later steps): every replay's outputs are cloned.
- memory: one pool per model device, shared by its blocks' graphs (replayed one after another on one stream).
Nothing here runs on a CPU: the planner says why graphs are off, and the blocks run as without the option.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("comfyui_accel")

MAX_RECORDINGS = 8  # per kind: graphs recorded beyond its first set (a LoRA strength slider moved this often)
WARMUP_CALLS = 1  # calls of a key run plainly before it is captured (cuBLAS workspaces, lazy kernels load)
GRAPH_MARGIN = 0.97  # whole steps with graphs must beat those without by 3% in every comparison (as auto_mode)
SAMPLES_PER_SIDE = 2


@dataclass(frozen=True)
class GraphInputs:
    """What the planner reads for one kind in one call: the option, the device and its policy, the kind's path
    in this call, and the model's load state."""
    requested: bool  # CompileOptions.cuda_graphs
    device_type: str
    policy_allows: bool = True  # hardware policy's "cuda_graphs" (cudaMallocAsync, ACCEL_DISABLE_CUDA_GRAPHS)
    policy_reason: str = ""
    runs_compiled: bool = True  # the kind's route runs it compiled in this call (not eager, profile, background)
    partially_loaded: bool = False  # ComfyUI's model_lowvram: some weights are offloaded and cast per call
    recordings: int = 0  # graphs the kind recorded again for new weight addresses so far
    whole_step_verdict: str | None = None  # choose="auto": GraphCheck's verdict, None while checking


@dataclass(frozen=True)
class GraphDecision:
    graphed: bool
    reason: str


def plan_kind(state: GraphInputs) -> GraphDecision:
    """Whether the kind's compiled calls replay CUDA graphs in this call, and why (or why not)."""
    if not state.requested:
        return GraphDecision(False, "off (cuda graphs not asked for)")
    if state.device_type != "cuda":
        return GraphDecision(False, f"off: CUDA graphs need a CUDA device, this model runs on {state.device_type}")
    if not state.policy_allows:
        return GraphDecision(False, f"off: {state.policy_reason}")
    if not state.runs_compiled:
        return GraphDecision(False, "off for this kind: its blocks do not run compiled in this call")
    if state.partially_loaded:
        return GraphDecision(False, "off while the model is partially loaded (weights move per call): plain "
                                    "compiled graphs")
    if state.recordings > MAX_RECORDINGS:
        return GraphDecision(False, f"off for this kind: its weights moved {state.recordings} times (LoRA, Swap "
                                    "Weights or dynamic VRAM), so it runs its plain compiled graph")
    if state.whole_step_verdict == "plain":
        return GraphDecision(False, "off: whole steps were not faster with graphs")
    return GraphDecision(True, "on" if state.whole_step_verdict else "on, timing whole steps with and without")


def status_line(requested: bool, device_type: str, policy_allows: bool, policy_reason: str,
                check: "GraphCheck | None" = None) -> str | None:
    """The node's status words about graphs: None when they were not asked for."""
    if not requested:
        return None
    decision = plan_kind(GraphInputs(True, device_type, policy_allows, policy_reason,
                                     whole_step_verdict=check.verdict if check else None))
    if decision.graphed and check is not None and check.verdict is not None:
        return f"CUDA graphs {check.reason}"
    return f"CUDA graphs {decision.reason}"


@dataclass
class GraphCheck:
    """choose="auto": whole steps with graphs against the same compiled blocks without, alternating in pairs on
    real calls, one comparison per kind of call (its shape and block count); graphs stay only if each graphed
    call was faster than every plain one by GRAPH_MARGIN."""
    samples: dict = field(default_factory=dict)  # call key -> {"graphed": [...], "plain": [...]}
    calls: int = 0
    verdict: str | None = None  # None while checking, then "graphed" or "plain"
    reason: str = ""

    def next_side(self) -> str:
        if self.verdict is not None:
            return self.verdict
        return "graphed" if (self.calls // 2) % 2 == 0 else "plain"

    def record(self, call_key: tuple, side: str, seconds: float) -> None:
        if self.verdict is not None:
            return
        self.calls += 1
        by_side = self.samples.setdefault(call_key, {"graphed": [], "plain": []})
        by_side[side].append(seconds)
        if all(len(t) >= SAMPLES_PER_SIDE for t in by_side.values()):
            graphed, plain = max(by_side["graphed"]), min(by_side["plain"])
            self.verdict = "graphed" if graphed < plain * GRAPH_MARGIN else "plain"
            self.reason = (f"{'on' if self.verdict == 'graphed' else 'off'}: whole steps took at most "
                           f"{graphed * 1e3:.1f} ms with graphs vs at least {plain * 1e3:.1f} ms without")
            log.info("[Accel] Compile Model: CUDA graphs %s", self.reason)

    def stats(self) -> dict:
        return {"verdict": self.verdict or "checking", "reason": self.reason, "calls_timed": self.calls,
                "seconds": {str(list(k)): v for k, v in self.samples.items()}}


def weight_addresses(block) -> tuple:
    """The data pointers of a block's weights: a graph replays the addresses it was captured with."""
    return tuple(p.data_ptr() for p in block.parameters())


def tensors_of(value, found: list) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors_of(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            tensors_of(v, found)
    return found


def replace_tensors(value, new: Callable):
    import torch

    if isinstance(value, torch.Tensor):
        return new(value)
    if isinstance(value, (list, tuple)):
        return type(value)(replace_tensors(v, new) for v in value)
    if isinstance(value, dict):
        return {k: replace_tensors(v, new) for k, v in value.items()}
    return value


def call_key(args: tuple, kwargs: dict, block) -> tuple:
    """A graph's key: its inputs' layouts, the call's other values, and the weights' addresses."""
    def describe(value):
        if hasattr(value, "data_ptr"):
            return ("T", tuple(value.shape), tuple(value.stride()), str(value.dtype), str(value.device))
        if isinstance(value, (list, tuple)):
            return tuple(describe(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, describe(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
        return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__
    return describe(args), describe(kwargs), weight_addresses(block)


class _Captured:
    """One captured graph: static inputs (the caller's values are copied in), static outputs (cloned out), and
    which inputs the block changes in place (copied back to the caller's tensors after each replay)."""

    def __init__(self, graph, inputs: list, outputs, mutated: list[int]):
        self.graph, self.inputs, self.outputs, self.mutated = graph, inputs, outputs, mutated

    def replay(self, args: tuple, kwargs: dict):
        given = tensors_of((args, kwargs), [])
        for static, value in zip(self.inputs, given):
            static.copy_(value)
        self.graph.replay()
        for index in self.mutated:
            given[index].copy_(self.inputs[index])
        return replace_tensors(self.outputs, lambda t: t.clone())


class BlockGraphs:
    """The captured graphs of one kind (CUDA only): per block and key, warm-up calls, then a capture, then
    replays. `recordings` counts graphs recorded for a block that had one already (its weights moved)."""

    def __init__(self, label: str):
        self.label = label
        self.graphs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # block -> {key: _Captured}
        self.seen: dict[tuple, int] = {}  # (id(block), key) -> plain calls so far
        self.recordings = 0
        self.replays = 0
        self.captures = 0
        self.failure: str | None = None
        self._lock = threading.Lock()

    def run(self, block, args: tuple, kwargs: dict, call: Callable):
        """`call(args, kwargs)` (the block's compiled call), replayed from a graph once warm."""
        if self.failure:
            return call(args, kwargs)
        import torch

        key = call_key(args, kwargs, block)
        by_key = self.graphs.setdefault(block, {})
        captured = by_key.get(key)
        if captured is not None:
            self.replays += 1
            return captured.replay(args, kwargs)
        warm = self.seen.get((id(block), key), 0)
        if warm < WARMUP_CALLS:
            out = call(args, kwargs)
            if tensors_of(out, []):  # served by the kind's graphs (not WOULD_COMPILE): a warm call
                self.seen[(id(block), key)] = warm + 1
            return out
        try:
            captured = self._capture(torch, args, kwargs, call)
        except Exception as err:  # a block that cannot be captured runs its compiled graph: never a failed prompt
            self.failure = f"capture failed ({type(err).__name__}: {str(err)[:200]})"
            log.warning("[Accel] Compile Model: CUDA graphs off for %s: %s", self.label, self.failure)
            return call(args, kwargs)
        if by_key and any(k[2] != key[2] for k in by_key):
            self.recordings += 1  # the same block with its weights at new addresses
        by_key[key] = captured
        self.captures += 1
        return captured.replay(args, kwargs)

    def _capture(self, torch, args: tuple, kwargs: dict, call: Callable) -> _Captured:
        given = tensors_of((args, kwargs), [])
        static = [t.clone() for t in given]
        position = iter(static)
        static_args, static_kwargs = replace_tensors((args, kwargs), lambda t: next(position))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # one run of the block on the capture stream (as torch's docs ask)
            call(*replace_tensors((static_args, static_kwargs), lambda t: t.clone()))
        stream.wait_stream(side)
        before = [t._version for t in static]  # an in-place op on an input bumps its version, captured or not
        with torch.cuda.graph(graph, pool=_pool(given[0].device if given else None)):
            outputs = call(static_args, static_kwargs)
        if not tensors_of(outputs, []):
            raise RuntimeError("the compiled call returned no tensor (it would have compiled)")
        mutated = [i for i, t in enumerate(static) if t._version != before[i]]
        return _Captured(graph, static, outputs, mutated)

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "recordings": self.recordings,
                "failure": self.failure}


_pools: dict = {}


def _pool(device):
    """One memory pool per device for every block graph on it (they replay one after another on one stream)."""
    import torch

    if device not in _pools:
        _pools[device] = torch.cuda.graph_pool_handle()
    return _pools[device]


_kinds: dict[tuple, BlockGraphs] = {}


def graphs_of(entry) -> BlockGraphs:
    """The graphs of a kind (registry entry), made at its first graphed call."""
    found = _kinds.get(entry.key)
    if found is None:
        found = _kinds[entry.key] = BlockGraphs(entry.kind.label)
    return found


def kind_stats(entry) -> dict | None:
    found = _kinds.get(entry.key)
    return found.stats() if found is not None else None


_checks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model record -> GraphCheck (choose=auto)


@dataclass
class GraphCall:
    """One model call's graphs: the kinds that replay them, and whether the call is a GraphCheck sample."""
    kinds: set
    side: str | None = None  # "graphed" or "plain" when the call's time is a whole-step sample
    captures_before: int = 0  # a call that captured is no fair sample


def check_of(record) -> GraphCheck | None:
    return _checks.get(record)


def plan_graphs(record, routes: dict, always_compiled: bool, policy, device_type: str,
                partially_loaded: bool) -> GraphCall | None:
    """The graphs of one call of `record`'s model (None: the option is off, or the model runs no compiled
    blocks yet). choose="auto" takes graphs only once whole steps kept the compiled blocks, then times whole
    steps with and without them (GraphCheck)."""
    if not record.options.cuda_graphs:
        return None
    check = None
    if record.auto is not None:
        if record.auto.verdict != "compiled":
            return None  # graphs would disturb the kinds' and whole steps' timing: they come after
        check = _checks.setdefault(record, GraphCheck())
    side = check.next_side() if check is not None else "graphed"
    sample = side if check is not None and check.verdict is None else None
    kinds = set()
    from .routes import Route

    compiled_routes = (Route.COMPILED, Route.CHOSEN, Route.CHOSEN_OFF_PROMPT)
    for entry in {e.key: e for e in record.entries}.values():
        graphs = _kinds.get(entry.key)
        decision = plan_kind(GraphInputs(
            True, device_type, policy.allows("cuda_graphs"), policy.explain("cuda_graphs"),
            routes.get(entry.key) in compiled_routes and (always_compiled or entry.path == "compiled"),
            partially_loaded, graphs.recordings if graphs else 0, check.verdict if check else None))
        if decision.graphed:
            kinds.add(entry.key)
    if not kinds:  # no kind may replay a graph (a CPU, the policy, a partial load): nothing to run or time
        return None
    return GraphCall(kinds if side == "graphed" else set(), sample, sum(g.captures for g in _kinds.values()))


def finish_graphs(record, call: GraphCall | None, seconds: float, key: tuple) -> None:
    """A GraphCheck sample's time, unless the call captured a graph (capturing is no replay)."""
    if call is None or call.side is None or sum(g.captures for g in _kinds.values()) != call.captures_before:
        return
    check = _checks.get(record)
    if check is not None:
        check.record(key, call.side, seconds)


def warn_if_off(options, policy, device) -> None:
    """Once per device: asked-for graphs that cannot run here, and why (the blocks run as without them)."""
    if not options.cuda_graphs:
        return
    decision = plan_kind(GraphInputs(True, device.type, policy.allows("cuda_graphs"), policy.explain("cuda_graphs")))
    if not decision.graphed:
        from .policy import warn_once

        warn_once(device, "cuda_graphs", f"CUDA graphs {decision.reason}; the blocks run as without them")
