"""Where one block kind stands with the background compiler: a closed set of states, one owner of the moves.

Every move a kind makes goes through `KindBackground`, so the states and who may change them are in one place:

    UNDECIDED --capture()------> CAPTURED --sent()---> PENDING --done()--> DONE
        |                           |                     |
        +--not_needed()--> NOT_NEEDED <--not_needed()-----+--failed()--> FAILED   (also from CAPTURED)

UNDECIDED: not looked at yet. NOT_NEEDED: compiled here (warm, or found in the persistent cache, or too small to
compile at all). CAPTURED: one of its blocks was captured in this call, sent to a child when the call ends.
PENDING: a child compiles it. DONE: the child's graphs are in the persistent cache, the next call loads them.
FAILED: it could not be sent or the child failed; it compiles here at its next call.
"""
from __future__ import annotations

import enum
import logging

log = logging.getLogger("comfyui_accel")


class BackgroundState(enum.Enum):
    UNDECIDED = "undecided"
    NOT_NEEDED = "not needed"
    CAPTURED = "queued"
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


# States in which the kind's blocks run eagerly because a child has (or will have) its compile.
WAITING_STATES = (BackgroundState.CAPTURED, BackgroundState.PENDING)
# States after which this process compiles (or loads) the kind itself.
SETTLED_STATES = (BackgroundState.NOT_NEEDED, BackgroundState.DONE, BackgroundState.FAILED)


class KindBackground:
    """One kind's background state, its reason and the child's compile time."""

    def __init__(self, label: str):
        self.label = label
        self.state = BackgroundState.UNDECIDED
        self.reason = ""
        self.seconds: float | None = None

    @property
    def waiting(self) -> bool:
        return self.state in WAITING_STATES

    @property
    def undecided(self) -> bool:
        return self.state is BackgroundState.UNDECIDED

    def capture(self) -> None:
        assert self.state is BackgroundState.UNDECIDED, self.state
        self.state = BackgroundState.CAPTURED

    def not_needed(self, why: str = "") -> None:
        self.state, self.reason = BackgroundState.NOT_NEEDED, why

    def sent(self) -> None:
        assert self.state is BackgroundState.CAPTURED, self.state
        self.state = BackgroundState.PENDING

    def done(self, seconds: float) -> None:
        self.state, self.seconds = BackgroundState.DONE, seconds
        self.reason = f"compiled in a child process in {seconds:.1f} s"

    def failed(self, why: str) -> None:
        self.state, self.reason = BackgroundState.FAILED, f"background compile failed: {why}; compiled here"
        log.warning("[Accel] %s: %s", self.label, self.reason)

    def stats(self) -> dict:
        state = None if self.state is BackgroundState.UNDECIDED else self.state.value
        return {"state": state, "reason": self.reason, "seconds": self.seconds}
