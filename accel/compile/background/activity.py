"""The pack's own work that competes with the sampler for the machine, so that no timing is taken beside it.

Auto mode decides from timings of the sampler's real calls (kind_choice.py, auto_mode.py). A timing taken while
the pack itself compiles in a child or runs inductor's CPU checks (new Python processes) measures the pack's
work as much as the block: on the 2-core test CPU such
samples made compiled blocks look several times slower than eager. So a timing counts only when no such work
ran at any moment of it: `Window` notes what ran when it opened and what started since, and a sample whose window
saw any is dropped (counted, never averaged in).

Each kind of work says when it runs (`running`, a context manager, or `watch` for a work whose end another
thread only notices later, such as a child's job). Nothing here waits or slows anything down: a window is two
reads of a counter and a look at the watched work.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Callable, Iterator


class PackActivity:
    def __init__(self):
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()
        self._started = 0  # every start of any work, so a work that began and ended inside a window is seen
        self._watched: list[tuple[str, Callable[[], bool]]] = []

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[None]:
        """The pack's `what` runs for the length of the block."""
        with self._lock:
            self._running[what] += 1
            self._started += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[what] -= 1
                if not self._running[what]:
                    del self._running[what]

    def started(self) -> None:
        """A watched work (see `watch`) started: windows open now cannot be clean."""
        with self._lock:
            self._started += 1

    def watch(self, what: str, is_running: Callable[[], bool]) -> None:
        """Work whose end is seen by asking (`is_running()`, cheap: a child's job is done when its file exists)."""
        self._watched.append((what, is_running))

    def now(self) -> list[str]:
        """What of the pack's own work runs at this moment."""
        with self._lock:
            running = list(self._running)
        return running + [what for what, is_running in self._watched if is_running()]

    @property
    def starts(self) -> int:
        with self._lock:
            return self._started

    def window(self) -> "Window":
        return Window(self, self.starts, self.now())


class Window:
    """From its opening to `competing()`: the pack's work that ran at any moment of it."""

    def __init__(self, activity: PackActivity, started: int, running: list[str]):
        self._activity, self._started, self._running = activity, started, running

    def competing(self) -> list[str]:
        """What ran during the window (empty: a clean sample)."""
        began = self._activity.starts != self._started
        found = set(self._running) | set(self._activity.now())
        if began and not found:
            found.add("pack work that started and ended meanwhile")
        return sorted(found)


ACTIVITY = PackActivity()


class DroppedSamples:
    """Samples refused because the pack's own work ran, by what ran: kept with a verdict, shown in the stats."""

    def __init__(self):
        self.by_work: Counter[str] = Counter()

    def note(self, competing: list[str]) -> None:
        self.by_work[", ".join(competing)] += 1

    @property
    def total(self) -> int:
        return sum(self.by_work.values())

    def describe(self) -> str:
        """"" when none were dropped, else a clause for a verdict's reason."""
        if not self.by_work:
            return ""
        parts = [f"{n} while {what} ran" for what, n in self.by_work.most_common()]
        return f"{self.total} sample{'s' if self.total > 1 else ''} dropped ({'; '.join(parts)})"
