"""Where one block kind stands with the background compiler: a closed set of states, one owner of the moves.

Every move a kind makes goes through `KindBackground`, so the states and who may change them are in one place:

    UNDECIDED --capture()------> CAPTURED --sent()---> PENDING --done()--> DONE
        |                           |                     |
        +--not_needed()--> NOT_NEEDED <--not_needed()-----+--failed()--> FAILED   (also from CAPTURED)

    NOT_NEEDED or DONE --new_shape()--> NEW_SHAPE_CAPTURED --sent()--> NEW_SHAPE_PENDING --done()--> DONE
                                                                    (failed() from either: FAILED)

    UNDECIDED --await_cpu_checks()--> AWAITING_CPU_CHECKS --cpu_checks_done()--> NOT_NEEDED

    UNDECIDED, NOT_NEEDED or DONE --save()--> SAVE_CAPTURED --sent()--> SAVE_PENDING --done()--> DONE
                                                                    (failed() from either: FAILED)

UNDECIDED: not looked at yet. NOT_NEEDED: compiled here (warm, or found in the persistent cache, or too small to
compile at all). CAPTURED: one of its blocks was captured in this call, sent to a child when the call ends.
PENDING: a child compiles it. DONE: the child's graphs are in the persistent cache, saved whole where torch can
(precompiled.py); this process loads them at its next idle moment (loader.py; on the CPU once its checks ran:
cpu_checks.py), which changes no state.
FAILED: it could not be sent or the child failed; it compiles here at its next call.
NEW_SHAPE_*: the kind runs compiled, and a call with inputs of a new shape (a longer prompt, another size) would
compile again: a child compiles that graph while calls of the new shape run eagerly, those of shapes already
compiled still run compiled.
AWAITING_CPU_CHECKS: found precompiled in the persistent cache on the CPU; its blocks run eagerly until
inductor's per-process CPU checks ran in a thread (cpu_checks.py), then it loads at its next call.
SAVE_*: the kind compiled a graph in this process (choose="always compiled", background=false, or a kind this
process compiles itself) and runs it; a child saves that graph whole, as it saves what it compiles, so a restart
or a fleet worker loads it instead of tracing it (issue #71: one compile path). Its blocks never wait for it.
"""
from __future__ import annotations

import enum
import logging

log = logging.getLogger("comfyui_accel")

# Kinds whose graphs torch refused to save whole, warned of once a process (a kind's every new shape would repeat
# it): a silent fallback hid that no block could be precompiled on ComfyUI 0.33 until 2026-11-27.
_WARNED_NOT_PRECOMPILED: set[str] = set()


class BackgroundState(enum.Enum):
    UNDECIDED = "undecided"
    NOT_NEEDED = "not needed"
    CAPTURED = "queued"
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    NEW_SHAPE_CAPTURED = "new shape queued"
    NEW_SHAPE_PENDING = "new shape compiling"
    AWAITING_CPU_CHECKS = "in the cache, loads after the CPU checks"
    SAVE_CAPTURED = "compiled here, queued to be saved whole"
    SAVE_PENDING = "compiled here, being saved whole"


# States in which the kind's blocks run eagerly because a child has (or will have) its compile, or (found in the
# cache) until this process's CPU checks are done.
WAITING_STATES = (BackgroundState.CAPTURED, BackgroundState.PENDING, BackgroundState.AWAITING_CPU_CHECKS)
# States after which this process compiles (or loads) the kind itself.
SETTLED_STATES = (BackgroundState.NOT_NEEDED, BackgroundState.DONE, BackgroundState.FAILED)
# States in which calls of a new input shape run eagerly while a child compiles that shape's graph.
NEW_SHAPE_STATES = (BackgroundState.NEW_SHAPE_CAPTURED, BackgroundState.NEW_SHAPE_PENDING)
# States in which a child saves whole what the kind compiled here (its blocks run that graph meanwhile).
SAVING_STATES = (BackgroundState.SAVE_CAPTURED, BackgroundState.SAVE_PENDING)
# States from which what the kind compiles here next goes to a child to be saved whole (none is on it).
MAY_SAVE_STATES = (BackgroundState.UNDECIDED, BackgroundState.NOT_NEEDED, BackgroundState.DONE)


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

    @property
    def compiling_new_shape(self) -> bool:
        return self.state in NEW_SHAPE_STATES

    @property
    def may_compile_new_shape(self) -> bool:
        """A new input shape of this kind can go to a child: the kind's first graph is made and no child is on
        it (a kind that failed in a child compiles here)."""
        return self.state in (BackgroundState.NOT_NEEDED, BackgroundState.DONE)

    @property
    def saving(self) -> bool:
        return self.state in SAVING_STATES

    @property
    def may_save(self) -> bool:
        return self.state in MAY_SAVE_STATES

    def save(self) -> None:
        assert self.may_save, self.state
        self.state = BackgroundState.SAVE_CAPTURED
        self.reason = "compiled in this process; a child saves its graphs whole after the call"

    def capture(self) -> None:
        assert self.state is BackgroundState.UNDECIDED, self.state
        self.state = BackgroundState.CAPTURED

    def await_cpu_checks(self) -> None:
        assert self.state is BackgroundState.UNDECIDED, self.state
        self.state = BackgroundState.AWAITING_CPU_CHECKS
        self.reason = ("found precompiled in the persistent compile cache; runs eagerly until inductor's CPU checks "
                       "are done")

    def cpu_checks_done(self) -> None:
        if self.state is BackgroundState.AWAITING_CPU_CHECKS:
            self.not_needed("found precompiled in the persistent compile cache (loaded after inductor's CPU checks)")

    def new_shape(self) -> None:
        assert self.may_compile_new_shape, self.state
        self.state = BackgroundState.NEW_SHAPE_CAPTURED

    def not_needed(self, why: str = "") -> None:
        self.state, self.reason = BackgroundState.NOT_NEEDED, why

    def sent(self) -> None:
        pending = {BackgroundState.CAPTURED: BackgroundState.PENDING,
                   BackgroundState.NEW_SHAPE_CAPTURED: BackgroundState.NEW_SHAPE_PENDING,
                   BackgroundState.SAVE_CAPTURED: BackgroundState.SAVE_PENDING}
        assert self.state in pending, self.state
        self.state = pending[self.state]

    def done(self, seconds: float, precompiled: int | str | None = None, refused: bool = False,
             in_pieces: str | None = None) -> None:
        """The child compiled it; `precompiled`: how many graphs it saved whole (precompiled.py), or why none;
        `refused`: torch raised while saving or loading one (child/compile_kind.save_precompiled), which a user
        should see; `in_pieces`: instead, the child met a graph break (why), compiled nothing, and the kind runs
        eagerly."""
        new_shape, saved = self.state is BackgroundState.NEW_SHAPE_PENDING, self.saving
        self.state, self.seconds = BackgroundState.DONE, seconds
        how = ("" if precompiled is None else f", {precompiled} graphs precompiled" if isinstance(precompiled, int)
               else f", not precompiled ({precompiled}): it loads through Dynamo")
        self.reason = f"{'a new input shape ' if new_shape else ''}compiled in a child process in {seconds:.1f} s{how}"
        if saved:
            self.reason = f"compiled in this process; a child process saved it in {seconds:.1f} s{how}"
        if in_pieces is not None:
            self.reason = f"a child process found in {seconds:.1f} s that it does not compile whole ({in_pieces})"
        if refused and self.label not in _WARNED_NOT_PRECOMPILED:
            _WARNED_NOT_PRECOMPILED.add(self.label)
            log.warning("[Accel] %s: its graphs compiled in a child process but could not be saved whole (%s), so "
                        "this process traces them again at its next call (seconds, from torch's caches), and so "
                        "will every restart. Outputs are unchanged. Please report it with your ComfyUI and torch "
                        "versions; ACCEL_PRECOMPILED=0 stops the pack trying.", self.label, precompiled)

    def failed(self, why: str) -> None:
        self.state, self.reason = BackgroundState.FAILED, f"background compile failed: {why}; compiled here"
        log.warning("[Accel] %s: %s", self.label, self.reason)

    def stats(self) -> dict:
        state = None if self.state is BackgroundState.UNDECIDED else self.state.value
        return {"state": state, "reason": self.reason, "seconds": self.seconds}
