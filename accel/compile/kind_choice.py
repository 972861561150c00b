"""choose="auto" for one block kind: compile it at all, and keep its compiled or its eager path.

Two questions, answered from the sampler's own calls and never from extra ones:
1. Is the kind worth compiling? Its blocks' share of an eagerly run UNet call (measured by auto_mode's profile
   call, or read from an earlier process through saved_shares.py): under MIN_CALL_SHARE, never compiled.
2. Is it faster compiled? Its blocks' real calls alternate between the compiled and the eager path, each timed,
   until both sides have TIMED_CALLS_PER_SIDE calls; the faster side (best of each) is kept.

Timing real calls, instead of running a block again to time it, means measuring never changes a result: every
block runs exactly once per call, on its own inputs, whatever it does to them (ComfyUI's Flux blocks add into
their inputs in place) and whatever state it keeps. Blocks of one kind run the same code on the same shapes, so
a call of one block is as good a sample as a call of its neighbour; a kind with many blocks decides within one
UNet call, a kind of one block within a few.
"""
from __future__ import annotations

import logging

from .saved_shares import saved_share

log = logging.getLogger("comfyui_accel")

# A kind whose blocks take less than this share of an eager UNet call is not compiled: compiling it costs about
# as much whatever its share, and can save at most its share of the call.
MIN_CALL_SHARE = 0.04
# Keep compiled only when faster by this margin, so timing noise cannot make us slower than eager.
FASTER_MARGIN = 0.98
TIMED_CALLS_PER_SIDE = 3
SIDES = ("compiled", "eager")


class KindChoice:
    """What auto mode decided for one kind (shared by every model using the kind), and its evidence."""

    def __init__(self, label: str, share_id: str, device_type: str):
        self.label = label
        self.share_id = share_id  # the kind on this device and torch, whatever the options (saved_shares.py)
        self.share: float | None = None
        self.path: str | None = None  # None until decided, then "compiled" or "eager"
        self.reason = ""
        self.timings: dict[str, float] = {}
        self._times: dict[str, list[float]] = {side: [] for side in SIDES}
        self._turn = 0
        saved = saved_share(device_type, share_id)
        if saved is not None:
            self.note_share(saved, measured_here=False)

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

    def next_side(self) -> str:
        """Question 2: which path this real call of the kind takes (compiled first: its first call compiles)."""
        side = SIDES[self._turn % 2]
        self._turn += 1
        return side

    def record(self, side: str, seconds: float) -> None:
        if self.path is not None:
            return  # decided meanwhile (a share measured, a failure): later samples change nothing
        self._times[side].append(seconds)
        if all(len(times) >= TIMED_CALLS_PER_SIDE for times in self._times.values()):
            compiled_s, eager_s = min(self._times["compiled"]), min(self._times["eager"])
            self.timings = {"compiled_s": compiled_s, "eager_s": eager_s}
            self.path = "compiled" if compiled_s < eager_s * FASTER_MARGIN else "eager"
            self.reason = f"compiled {compiled_s * 1e3:.2f} ms vs eager {eager_s * 1e3:.2f} ms per call"
            log.info("[Accel] %s: keeping the %s path (%s)", self.label, self.path, self.reason)

    def progress(self) -> str:
        """Where question 2 stands, for stats while undecided ("" before its first timed call)."""
        if not any(self._times.values()):
            return ""
        return (f"timing real calls: {len(self._times['compiled'])} compiled and {len(self._times['eager'])} eager "
                f"of {TIMED_CALLS_PER_SIDE} each")
