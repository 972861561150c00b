"""Planning each Compile Model call once, and choose="auto"'s stages: the one home of auto mode.

`plan_call` decides, before a UNet call, how the whole call runs (its `CallMode`) and each block kind's route in it
(routes.py); `finish_call` takes the call's timings after it. Per block, dispatch.py only runs that route. Auto
mode's stages, all on the sampler's real calls, never on extra ones (so measuring never changes a result):

1. PROFILE: a model's first call runs eagerly and times each kind's share of it. A kind under
   kind_choice.MIN_CALL_SHARE is never compiled. Shares are saved for later processes (saved_findings.py).
2. DISPATCH while kinds are undecided: each undecided kind's real block calls alternate between its compiled and
   eager path, timed, and the kind keeps the faster (kind_choice.py). Cold kinds meanwhile may compile in a
   child process (background/), their blocks running eagerly until it is done; so may a compiled kind's new
   input shape (a longer prompt, another size), its calls of that shape running eagerly meanwhile.
3. CHECK_COMPILED / CHECK_EAGER: once every kind has its path, the model's next calls alternate between those
   paths and plain eager. Kinds can win alone and still make the whole call slower (measured on a CPU,
   docs/benchmarks/compile_model.md), so when one kind of call (same input shape, same number of block calls,
   so DeepCache's shallow calls are never compared with full ones) has been timed enough on both sides, the
   model keeps its compiled blocks only if each compiled call was faster than every eager one by a margin;
   otherwise it runs eagerly from then on
   (EAGER: no per-block dispatch at all). A call that compiled, decided a kind or sent one to the background is
   no sample of either path.

No stage takes a sample while the pack's own work runs (a child compiling, inductor's CPU checks:
background/activity.py): such a profile call, kind timing or whole-call sample is dropped and counted, and the
verdict says how many were. The verdicts hold for the model, its clones and its options on that device
(model_record.py), except an eager verdict that was a close call: it is checked again a few sampling runs later,
at most twice (the rule: kind_choice.RECHECK_BAND).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..cache import COMPILE_CACHE
from .background import ACTIVITY, BACKGROUND, IDLE_GATE, SETTLED_STATES, DroppedSamples, hold_until_idle
from .kind_choice import FASTER_MARGIN, MAX_RECHECKS, RECHECK_AFTER_RUNS, RECHECK_BAND
from .kinds import KindEntry
from .routes import CallMode, CallPlan
from .saved_findings import save_shares

log = logging.getLogger("comfyui_accel")

SAMPLES_PER_PATH = 2
# Keep the compiled blocks only when whole calls are faster by the kinds' margin: within timing noise, eager is the
# safe choice. A name of its own so that a test can hold the kinds compiled and still decide on whole calls.
WHOLE_CALL_MARGIN = FASTER_MARGIN
# Calls that never line up (every call a new shape): stop checking and keep what the per-kind timing chose.
MAX_CALLS = 24
# The model calls' inputs_keys kept as settled (a set of small tuples): a conditioning value that changes at every
# prompt would otherwise grow it without end; emptied, it only costs blocks a look for new shapes until refilled.
MAX_INPUTS_SEEN = 1024


@dataclass
class AutoMode:
    """Auto mode's state for one model record: whether it was profiled, and its whole-call check."""
    model_label: str
    profiled: bool = False
    samples: dict[tuple, dict[str, list[float]]] = field(default_factory=dict)
    calls: int = 0
    verdict: str | None = None  # None while checking, then "compiled" or "eager"
    reason: str = ""
    dropped: DroppedSamples = field(default_factory=DroppedSamples)  # samples refused: the pack's work ran
    close_call: bool = False  # an eager verdict by less than the re-check band: checked again later
    settled_at_run: int = 0  # the sampling run (IDLE_GATE.runs) of the verdict
    rechecks: int = 0

    def next_check_path(self) -> str:
        # Pairs (compiled, compiled, eager, eager, ...), so that calls which alternate in kind (DeepCache's full
        # and shallow steps, cond and uncond run as separate calls) still see both paths.
        return "compiled" if (self.calls // 2) % 2 == 0 else "eager"

    def record(self, call_key: tuple, path: str, seconds: float) -> None:
        self.calls += 1
        by_path = self.samples.setdefault(call_key, {"compiled": [], "eager": []})
        by_path[path].append(seconds)
        if all(len(times) >= SAMPLES_PER_PATH for times in by_path.values()):
            self._decide(by_path)
        elif self.calls >= MAX_CALLS:
            self.settle("compiled", f"no {SAMPLES_PER_PATH} comparable calls on each path in {MAX_CALLS} calls; "
                                    "keeping the per-kind choice")

    def settle(self, verdict: str, reason: str, close_call: bool = False) -> None:
        dropped = self.dropped.describe()
        self.verdict, self.close_call, self.settled_at_run = verdict, close_call and verdict == "eager", IDLE_GATE.runs
        self.reason = reason + (f"; {dropped}" if dropped else "") + (
            "; a close call, checked again after a few more runs" if self.close_call and self.recheck_left else "")
        log.info("[Accel] Compile Model (%s): %s", self.model_label, self.reason)

    @property
    def recheck_left(self) -> bool:
        return self.rechecks < MAX_RECHECKS

    def recheck_due(self) -> bool:
        """An eager verdict that was a close call, RECHECK_AFTER_RUNS sampling runs old: check again."""
        return (self.verdict == "eager" and self.close_call and self.recheck_left
                and IDLE_GATE.runs >= self.settled_at_run + RECHECK_AFTER_RUNS)

    def start_recheck(self, entries: list[KindEntry]) -> None:
        """Check again from the start: kinds whose eager choice was a close call are timed again, then whole
        calls. Real calls only, as the first time."""
        self.rechecks += 1
        for entry in {e.key: e for e in entries}.values():
            if entry.choice.close_call and not entry.failure:
                entry.choice.recheck()
        self.samples, self.calls, self.verdict, self.close_call = {}, 0, None, False
        self.reason = f"checking again (re-check {self.rechecks} of {MAX_RECHECKS}: the eager verdict was a close call)"
        log.info("[Accel] Compile Model (%s): %s", self.model_label, self.reason)

    def _decide(self, by_path: dict[str, list[float]]) -> None:
        # Compiled must win every comparison: its slowest call beats the fastest eager one by the margin. A
        # median of two calls a side is a coin toss where the gain is under the machine's noise (on the 2-core
        # test CPU, identical eager steps of the benchmark Flux spread over 5%, and a median-based check kept
        # compiled blocks that were 8% slower in steady state, 2026-11-22); eager is the safe side of a tie.
        compiled_s, eager_s = max(by_path["compiled"]), min(by_path["eager"])
        faster = compiled_s < eager_s * WHOLE_CALL_MARGIN
        self.settle("compiled" if faster else "eager",
                    f"whole UNet calls took at most {compiled_s:.3f} s with the compiled blocks vs at least "
                    f"{eager_s:.3f} s eager ({len(by_path['compiled'])} and {len(by_path['eager'])} calls): " +
                    ("keeping the compiled blocks" if faster else
                     "running this model eagerly (compiled blocks were not clearly faster here; choose='always "
                     "compiled' keeps them anyway)"), close_call=compiled_s < eager_s * RECHECK_BAND)

    def status(self, entries: list[KindEntry]) -> str:
        """Where the model stands while there is no verdict yet, in words: why it has none (yet)."""
        if not self.profiled and any(e.choice.share is None for e in entries):
            return "waiting for its first call (it runs eagerly, timing each kind's share)"
        waiting = sorted({e.kind.label for e in entries if e.background.waiting})
        if waiting:
            return f"waiting for the background compile of {', '.join(waiting)}"
        undecided = sorted({e.kind.label for e in entries if not (e.choice.decided or e.failure)})
        if undecided:
            return f"timing compiled against eager per kind on real calls: {', '.join(undecided)} undecided"
        counts = {str(list(k)): {p: len(t) for p, t in v.items()} for k, v in self.samples.items()}
        return (f"checking whole calls: needs {SAMPLES_PER_PATH} comparable calls on each path, has {counts or 'none'}"
                f" after {self.calls} timed calls (the verdict comes with the next calls or prompt)")

    def stats(self, entries: list[KindEntry]) -> dict:
        return {"verdict": self.verdict or "checking", "reason": self.reason or self.status(entries),
                "calls_timed": self.calls, "seconds": {str(list(key)): times for key, times in self.samples.items()},
                "dropped_samples": dict(self.dropped.by_work), "rechecks": self.rechecks,
                "close_call": self.close_call}


def inputs_key(args: tuple, kwargs: dict) -> tuple:
    """What of a model call's inputs may change the shapes its blocks see: the tensor arguments' shapes (latent,
    timestep, prompt states), and the conditioning's (the keyword arguments) all through: a list's tensors (Flux
    Kontext's and Qwen-Image-Edit's reference latents, whose tokens join the image's) and plain values (Lumina 2's
    num_tokens cuts the prompt). A longer prompt, another size or another reference is another key. A few
    microseconds a call."""
    return (tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)),
            tuple((k, _conditioning_key(v)) for k, v in kwargs.items()))


def _conditioning_key(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, (list, tuple)):
        return tuple(_conditioning_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _conditioning_key(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def plan_call(record, always_compiled: bool, background_allowed: bool, device_type: str,
              inputs: tuple = ()) -> CallPlan | None:
    """How this call of `record`'s model runs; None when it runs as ComfyUI's own, without any dispatch.
    `inputs` is the call's inputs_key."""
    entries, auto = record.entries, record.auto
    if always_compiled or auto is None:
        pending = len({e.key for e in entries if e.compiles == 0 and not e.failure})
        return CallPlan(CallMode.DISPATCH, True, False, device_type, pending).fill_routes(entries)
    if auto.verdict == "eager":
        if not auto.recheck_due():
            return None  # whole calls were not faster compiled
        auto.start_recheck(entries)
    background = background_allowed
    if background:
        BACKGROUND.poll()  # a finished child hands its kinds back here
        # once every kind is decided and none waits, blocks dispatch as without a background compiler
        background = any(e.background.undecided or e.background.waiting or e.background.compiling_new_shape
                         for e in entries)
    if not auto.profiled and any(e.choice.share is None and not e.choice.decided and not e.failure
                                 for e in entries):
        return CallPlan(CallMode.PROFILE, False, background, device_type).fill_routes(entries)
    auto.profiled = True  # every kind's share is known (saved by an earlier process): nothing to profile
    checking = auto.verdict is None and all(e.choice.decided or e.failure for e in entries) and not any(
        e.background.waiting or e.background.compiling_new_shape or e.loads_between_prompts for e in entries)
    if checking and not any(e.path == "compiled" for e in entries):
        auto.settle("eager", "no block kind was worth compiling or faster compiled: running this model eagerly",
                    close_call=any(e.choice.close_call for e in entries))
        return None
    # Blocks look for inputs of a new shape to send to a child unless the call's inputs were seen in a settled
    # call (the look costs each block call tens of microseconds).
    new_shapes = background_allowed and (background or inputs not in record.inputs_seen)
    if checking:
        mode = CallMode.CHECK_COMPILED if auto.next_check_path() == "compiled" else CallMode.CHECK_EAGER
        return CallPlan(mode, False, background, device_type, _compiles_here(entries, background),
                        settled_before=_settled_state(entries), new_shapes_in_background=new_shapes,
                        compiles_in_background=background_allowed).fill_routes(entries)
    return CallPlan(CallMode.DISPATCH, False, background, device_type, _compiles_here(entries, background),
                    new_shapes_in_background=new_shapes, compiles_in_background=background_allowed).fill_routes(entries)


def start_call(record, plan: CallPlan) -> None:
    plan.served_before = _served(record.entries)
    plan.window = ACTIVITY.window() if plan.timed else None


def finish_call(record, plan: CallPlan, seconds: float, call_key: tuple, inputs: tuple = ()) -> None:
    """What the call measured goes where it belongs: which blocks ran how (the model's stats), kinds' shares,
    captures to the background compiler, whole-call samples to the check."""
    entries, auto = record.entries, record.auto
    if plan.new_shapes_in_background and not (plan.background or plan.captures or plan.graphs_missing):
        if len(record.inputs_seen) >= MAX_INPUTS_SEEN:  # a value that changes every prompt: look again
            record.inputs_seen.clear()
        record.inputs_seen.add(inputs)  # every kind settled and none met a new shape: later repeats need no look
    (compiled_before, eager_before), (compiled_after, eager_after) = plan.served_before, _served(entries)
    record.last_call = {"mode": plan.mode.value, "blocks": plan.blocks, "compiled": compiled_after - compiled_before,
                        "eager": dict(eager_after - eager_before)}
    competing = plan.window.competing() if plan.window is not None else []
    if competing:  # no sample: the next profile or check call measures again
        auto.dropped.note(competing)
    elif plan.mode is CallMode.PROFILE:
        auto.profiled = True
        measured = {e.key: e for e in entries if e.key in plan.kind_seconds}  # one per kind, not per block
        for entry in measured.values():
            entry.choice.note_share(plan.kind_seconds[entry.key] / seconds)
        save_shares(plan.device_type, {e.choice.share_id: e.choice.share for e in measured.values()})
    send_captures(plan)
    if (plan.mode in (CallMode.CHECK_COMPILED, CallMode.CHECK_EAGER) and not competing and not plan.graphs_missing
            and _settled_state(entries) == plan.settled_before):  # some blocks eager for a missing graph: no sample
        auto.record((*call_key, plan.blocks), "compiled" if plan.mode is CallMode.CHECK_COMPILED else "eager",
                    seconds)


def abandon_call(plan: CallPlan) -> None:
    """A call that raised (ComfyUI's interrupt, out of memory, a node's error): nothing it measured counts, but
    the captures it made (copies of blocks' inputs, taken before each ran) still go to the background compiler.
    Kept back, their kinds would wait for a compile nobody started, eager for the rest of the process."""
    if plan.captures:
        try:
            send_captures(plan)
        except Exception as err:  # the call's own error is the one to raise; this one is said
            log.warning("[Accel] Compile Model: the blocks captured in a call that failed were not sent to the "
                        "background compiler (%s: %s)", type(err).__name__, err)


def send_captures(plan: CallPlan) -> None:
    """The call's captures (dispatch.BlockDispatcher._capture) to the background compiler, when its call ended
    (a model call's, a VAE coding call's). After a profile call, kinds too small to matter are eager for good:
    nothing to compile for them."""
    if not plan.captures:
        return
    captures, device_type = list(plan.captures.values()), plan.device_type
    wanted = [c for c in captures if c.new_shape or c.save or (not c.entry.choice.decided and c.entry.failure is None)]
    for capture in captures:
        if capture not in wanted:
            capture.entry.background.not_needed(capture.entry.reason)
    BACKGROUND.launch(wanted, COMPILE_CACHE.environment(device_type).dir,  # kinds it cannot send: compiled here
                      hold=hold_until_idle(device_type))


def _served(entries: list[KindEntry]) -> tuple[int, Counter]:
    """Block calls the model's kinds ran compiled so far, and eagerly by reason (each kind counted once)."""
    unique = {e.key: e for e in entries}.values()
    return (sum(e.cache_hits + e.compiles for e in unique), sum((e.eager_calls for e in unique), Counter()))


def _compiles_here(entries: list[KindEntry], background: bool) -> int:
    """Kinds this call may compile in this process (those loading a child's work included)."""
    return len({e.key for e in entries if e.compiles == 0 and e.path != "eager"
                and (not background or e.background.state in SETTLED_STATES)})


def _settled_state(entries: list[KindEntry]) -> tuple[int, int, int, int]:
    """Compiles so far, kinds with a path chosen, kinds sent to a background compile and new shapes sent there,
    over a model's entries: unchanged by a call that only ran."""
    return (sum(e.compiles for e in entries), sum(e.choice.decided or e.failure is not None for e in entries),
            sum(not e.background.undecided for e in entries), sum(len(e.shapes.shapes_sent) for e in entries))
