"""choose="auto" for one block kind: compile it at all, and keep its compiled or its eager path.

Two questions, answered from the sampler's own calls and never from extra ones:
1. Is the kind worth compiling? Its blocks' share of an eagerly run UNet call (measured by auto_mode's profile
   call, or read from an earlier process through saved_findings.py): under MIN_CALL_SHARE, never compiled.
2. Is it faster compiled? Its blocks' real calls alternate between the compiled and the eager path, each timed,
   until both sides have TIMED_CALLS_PER_SIDE calls of one input shape; the faster side (best of each) is kept.

Timing real calls, instead of running a block again to time it, means measuring never changes a result: every
block runs exactly once per call, on its own inputs, whatever it does to them (ComfyUI's Flux blocks add into
their inputs in place) and whatever state it keeps. Blocks of one kind run the same code, so a call of one block
is as good a sample as a call of its neighbour of the same input shape. Shapes are never mixed: a kind can run
at two resolutions in one UNet call (the small SD1.5 UNet's SpatialTransformer[320->320] at 32x32 and 16x16
latents), and alternating sides over alternating resolutions once compared compiled calls at 32x32 with eager
ones at 16x16, so compiled looked 3x slower than eager when it was 1.8x faster (2026-11-25).

A sample taken while the pack's own work ran (a child compiling, inductor's CPU checks) is dropped
(background/activity.py), and an eager choice that was a close call is timed again later (`recheck`): the
rule is written once, in RECHECK_BAND's comment.
"""
from __future__ import annotations

import logging

from .background.activity import DroppedSamples
from .saved_findings import save_in_pieces, saved_in_pieces, saved_share

log = logging.getLogger("comfyui_accel")

# A kind whose blocks take less than this share of an eager UNet call is not compiled: compiling it costs about
# as much whatever its share, and can save at most its share of the call.
MIN_CALL_SHARE = 0.04
# Keep compiled only when faster by this margin, so timing noise cannot make us slower than eager.
FASTER_MARGIN = 0.98
TIMED_CALLS_PER_SIDE = 3
SIDES = ("compiled", "eager")
# The re-check rule (kinds here, whole calls in auto_mode.py): an eager choice whose compiled side was within this
# factor of eager (slower by less than the machine's noise, or faster by less than the margin) is a close call.
# It is timed again after RECHECK_AFTER_RUNS more sampling runs, at most MAX_RECHECKS times in the model's life:
# a few real calls on each side, never an extra call, so a re-check costs at most the gap of a close call.
RECHECK_BAND = 1.15
RECHECK_AFTER_RUNS = 3
MAX_RECHECKS = 2


class KindChoice:
    """What auto mode decided for one kind (shared by every model using the kind), and its evidence."""

    def __init__(self, label: str, share_id: str, device_type: str):
        self.label = label
        self.share_id = share_id  # the kind on this device and torch, whatever the options (saved_findings.py)
        self.device_type = device_type
        self.share: float | None = None
        self.path: str | None = None  # None until decided, then "compiled" or "eager"
        self.reason = ""
        self.timings: dict[str, float] = {}
        self._times: dict[tuple, dict[str, list[float]]] = {}  # by input shape, then side
        self._turns: dict[tuple, int] = {}
        self.dropped = DroppedSamples()
        self.rechecks = 0
        saved = saved_share(device_type, share_id)
        if saved is not None:
            self.note_share(saved, measured_here=False)
        in_pieces = saved_in_pieces(device_type, share_id)
        if in_pieces is not None:
            self.compiles_only_in_pieces(in_pieces, found_here=False)

    @property
    def decided(self) -> bool:
        return self.path is not None

    def note_share(self, share: float, measured_here: bool = True) -> None:
        """Question 1: a kind too small to matter is never compiled."""
        self.share = share
        if share < MIN_CALL_SHARE and self.path is None:
            self.path = "eager"
            self.reason = (f"{100 * share:.1f}% of a UNet call when run eagerly (under {100 * MIN_CALL_SHARE:.0f}%"
                           f"{'' if measured_here else ', measured earlier'}): not worth compiling")
            log.info("[Accel] %s: not compiled, %s", self.label, self.reason)

    def compiles_only_in_pieces(self, why: str, found_here: bool = True) -> None:
        """A child met a graph break in the kind: Dynamo compiles it only as several graphs, which cannot be saved
        as one precompiled function, so this process, and every restart, would trace it again in a prompt, frame
        by frame (Wan's VAE encode of one frame: 31 Dynamo frames and its recompile limit met, 25.8 s in a
        prompt for a 0.1 s call, on a quiet 2-core CPU, 2026-11-27). choose="auto" promises no compile in a
        prompt: the kind runs eagerly. Saved for later processes (saved_findings.py), which then send it to no
        child: `found_here` is False for what they read."""
        if self.path == "eager":
            return
        self.path = "eager"
        self.reason = (f"compiles only as several graphs (a graph break{'' if found_here else ', found earlier'}: "
                       f"{why}), which each process would trace again in a prompt: runs eagerly")
        if not found_here:
            # read when a process first meets the kind, whatever its choose option (always compiled does not ask
            # the choice): the warning was given when the kind was found; the reason is in its stats and status
            log.info("[Accel] %s: runs eagerly under choose=auto: it %s.", self.label,
                     self.reason.removesuffix(": runs eagerly"))
            return
        save_in_pieces(self.device_type, self.share_id, why)
        log.warning("[Accel] %s: runs eagerly: it %s. The output is unaffected. To compile it in the prompt anyway: "
                    "choose \"always compiled\" on Compile Model, mode low-memory on Compile VAE.", self.label,
                    self.reason.removesuffix(": runs eagerly"))

    def next_side(self, shape: tuple) -> str:
        """Question 2: which path this real call of the kind, with inputs of `shape`, takes (compiled first: its
        first call compiles). Sides alternate per shape, so each shape gets samples on both."""
        turn = self._turns[shape] = self._turns.get(shape, -1) + 1
        return SIDES[turn % 2]

    def record(self, shape: tuple, side: str, seconds: float) -> None:
        if self.path is not None:
            return  # decided meanwhile (a share measured, a failure): later samples change nothing
        times = self._times.setdefault(shape, {s: [] for s in SIDES})
        times[side].append(seconds)
        if all(len(t) >= TIMED_CALLS_PER_SIDE for t in times.values()):
            compiled_s, eager_s = min(times["compiled"]), min(times["eager"])
            self.timings = {"compiled_s": compiled_s, "eager_s": eager_s}
            self.path = "compiled" if compiled_s < eager_s * FASTER_MARGIN else "eager"
            dropped = self.dropped.describe()
            self.reason = (f"compiled {compiled_s * 1e3:.2f} ms vs eager {eager_s * 1e3:.2f} ms per call of "
                           f"{_shape_text(shape)}, clean samples{f'; {dropped}' if dropped else ''}")
            log.info("[Accel] %s: keeping the %s path (%s)", self.label, self.path, self.reason)

    def drop(self, competing: list[str]) -> None:
        """A sample taken while the pack's own work ran: refused."""
        self.dropped.note(competing)

    @property
    def close_call(self) -> bool:
        """Eager by less than the re-check band (see RECHECK_BAND)."""
        timings = self.timings
        return (self.path == "eager" and bool(timings)
                and timings["compiled_s"] < timings["eager_s"] * RECHECK_BAND)

    def recheck(self) -> None:
        """Time the kind again on its next calls (a close call, see RECHECK_BAND): undecided, samples cleared."""
        self.rechecks += 1
        self.path, self.timings, self._times, self._turns = None, {}, {}, {}
        self.reason = f"timed again (re-check {self.rechecks}: the last choice was a close call)"

    def progress(self) -> str:
        """Where question 2 stands, for stats while undecided ("" before its first timed call)."""
        if not self._times:
            return ""
        counts = max(self._times.values(), key=lambda t: min(len(t["compiled"]), len(t["eager"])))
        return (f"timing real calls: {len(counts['compiled'])} compiled and {len(counts['eager'])} eager of "
                f"{TIMED_CALLS_PER_SIDE} each, at one input shape")


def _shape_text(shape: tuple) -> str:
    """The first input's shape, as a person reads it: 2x320x32x32."""
    return "x".join(map(str, shape[0])) if shape and shape[0] else "its inputs"
