"""The idle gate (accel/compile/background/idle_gate.py) on its own: held background work starts at this process's
first idle moment outside a sampling run, never inside one, and never while the process is busy (a VAE decode
after the sampler), unless it has waited its longest or someone asks for it. Real threads and this process's
real CPU time; a fresh gate per test (the pack's own is shared by the process)."""
from __future__ import annotations

import threading
import time

import pytest


@pytest.fixture()
def gate(accel_pack):
    return accel_pack.accel.compile.background.idle_gate.IdleGate()


def busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(2000))


def wait_until(event: threading.Event, seconds: float) -> float | None:
    start = time.monotonic()
    return time.monotonic() - start if event.wait(seconds) else None


def test_held_work_waits_for_the_sampling_run_and_the_busy_decode_then_starts_when_idle(gate):
    started = threading.Event()
    gate.sampling_started()
    gate.when_idle(started.set)
    time.sleep(1.0)  # idle, but inside a sampling run (a GPU sampler barely uses the CPU)
    assert not started.is_set(), "held work started inside a sampling run"
    gate.sampling_ended()
    busy_for(1.5)  # the rest of the prompt, e.g. its VAE decode, in this thread
    assert not started.is_set(), "held work started beside the busy process"
    waited = wait_until(started, 5.0)
    assert waited is not None and waited < 2.0, f"held work did not start in the idle process ({waited})"
    assert gate.released == ["idle"] and not gate.holding


def test_a_busy_process_gets_its_work_started_after_the_longest_wait(gate, monkeypatch):
    monkeypatch.setenv("ACCEL_BACKGROUND_IDLE_WAIT", "1")
    started = threading.Event()
    gate.when_idle(started.set)
    busy_for(2.5)  # prompts back to back with no pause
    assert started.is_set(), "held work never started in a process that is never idle"
    assert gate.released == ["waited long enough"]


def test_prompts_back_to_back_get_their_work_started_between_two_of_them(gate, monkeypatch):
    """A queue of prompts: sampling runs with a busy decode between them. The longest wait is the time spent
    outside the runs, added up over them: the work starts in a gap once the gaps add up to it. Before, the wait
    started again at each run's end, so held work waited for the queue's end (found by a review)."""
    monkeypatch.setenv("ACCEL_BACKGROUND_IDLE_WAIT", "1")
    started = threading.Event()
    gate.when_idle(started.set)
    for _ in range(6):
        gate.sampling_started()
        busy_for(0.4)
        gate.sampling_ended()
        busy_for(0.4)  # the decode, the next prompt's set-up: busy, outside the run
        if started.is_set():
            break
    assert started.is_set(), "held work never started while prompts ran back to back"
    assert gate.released == ["waited long enough"], gate.released


def test_someone_waiting_releases_at_once_and_each_callback_runs_once(gate):
    calls = []
    gate.sampling_started()
    gate.when_idle(lambda: calls.append("jobs"))
    gate.when_idle(lambda: calls.append("checks"))
    gate.release_now()
    gate.sampling_ended()
    time.sleep(0.8)
    assert calls == ["jobs", "checks"] and not gate.holding


class SlowLoad:
    """A kind whose precompiled functions take until `release` to load, as KindEntry.load_precompiled does it (the
    loader only asks these three things of an entry)."""

    def __init__(self, label: str):
        self.kind = type("Kind", (), {"label": label})()
        self.precompiled = type("Graphs", (), {"due": True})()
        self.loading, self.release = threading.Event(), threading.Event()

    def load_precompiled(self) -> bool:
        self.loading.set()
        self.release.wait(10)
        self.precompiled.due = False
        return True


def test_a_kind_loading_now_is_still_pending(accel_pack):
    """What the demo and the HTTP tests wait on (BACKGROUND.busy) counts a kind whose load is under way: it once
    read only the loader's queue, which a load empties first, so a prompt could start before the load was done."""
    loader = accel_pack.accel.compile.background.loader.Loader()
    kind = SlowLoad("Block[8->8]")
    loader.load_when_idle([kind])
    assert loader.pending == ["Block[8->8]"]
    loader.wake()  # an idle moment
    assert kind.loading.wait(5), "the loader did not start"
    assert loader.pending == ["Block[8->8]"], "a kind loading now was not pending"
    kind.release.set()
    deadline = time.monotonic() + 5
    while loader.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader.pending == []
