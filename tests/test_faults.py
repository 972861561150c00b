"""Faults cost nothing but time (#16): through started ComfyUI servers, a kill -9 while the background child
compiles leaves no process of the server running; a restart on the same cache, beside a second server on that
cache compiling the same kind at once (a fleet on a shared volume), is correct, finishes the compile and clears the
killed server's job folders; an interrupt while a kind compiles in the prompt's path, or while DeepCache samples,
ends only that prompt, and the next one is correct. (Damaged cache files, an unwritable cache, a failing compile
and two probe processes on one cache: test_compile_cache.py; a full disk: test_cache_faults.py; an interrupt
during a swap: test_swap_weights.py.)
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from compile_helpers import assert_close_to_eager, assert_every_artifact_whole
from tools.soak_prompts import Prompt, cold_compiles, graph_of, run_latent, saved_latent, server_of

pytestmark = pytest.mark.server
PLAIN = Prompt("plain", steps=4)
# The compiles run on the generated SD3 transformer: one block kind, so a compile is long enough to interrupt or
# kill in, and short enough for CI (the SD1.5 UNet has several kinds, each compiled in turn).
SD3 = Prompt("sd3", model="sd3", cfg=4.5, steps=3)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (its children, theirs, ...), read from /proc."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            children = (task / "children").read_text().split() if (task / "children").exists() else []
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return False
    return "Z" not in state.split()[1]  # a zombie has ended; only its exit status waits for a reaper


def running_child(server, timeout: float = 120) -> int:
    """The pid of the background compile child, once it runs (held until the server is idle on few cores)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = server.get_json("/accel/stats")["compile"]["background"]["running"]
        if running and running.get("pid"):
            return running["pid"]
        time.sleep(0.2)
    raise AssertionError(f"no background child started: {server.get_json('/accel/stats')['compile']['background']}")


@pytest.mark.full(why=(
    "a server killed during a child's compile; make test ends prompts during a compile in "
    "test_an_interrupt_during_a_compile_or_sampling_ends_only_that_prompt"))
def test_kill_9_during_a_background_compile_leaves_nothing_running_and_a_restart_finishes_it(tmp_path, accel_pack):
    """A server killed (-9) while its child compiles: nothing of it keeps running. Then the restart and another
    server on the same cache directory (two workers of a fleet on a shared volume) get the prompt at once: both
    are correct, their children compile the kind at the same time, each server then loads the graphs without a
    cold compile, every artifact left is whole, and the killed server's job folders are gone."""
    compiled = replace(SD3, compiled=True)
    cache = {"ACCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_of(tmp_path / "first", env=cache) as first:
        eager = run_latent(first, SD3, "eager")
        assert torch.equal(run_latent(first, compiled, "cold"), eager), "the cold prompt did not run eagerly"
        child = running_child(first)
        time.sleep(2)  # well into the compile: the child's own compile workers have started
        below = descendants(first.proc.pid)
        assert child in below
        killed = first.proc.pid
        os.kill(killed, signal.SIGKILL)
        first.proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while [pid for pid in below if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in below if alive(pid)], "processes of the killed server kept running"

    # The restart, and beside it another worker of a fleet on the same cache (a shared volume): both get the
    # prompt at once, so their children compile the same kind at the same time.
    with server_of(tmp_path / "second", env=cache) as second, server_of(tmp_path / "third", env=cache) as third:
        workers = {"restart": second, "fleet": third}
        queued = {name: worker.queue_prompt(graph_of(compiled, name)) for name, worker in workers.items()}
        for name, worker in workers.items():
            worker.wait_for(queued[name], timeout=900)
            assert_close_to_eager(saved_latent(worker, name), eager, f"the {name} server's first prompt")
        for name, worker in workers.items():
            worker.wait_for_background()
            jobs = worker.get_json("/accel/stats")["compile"]["background"]["finished"]
            assert jobs and all(job["returncode"] == 0 and not job["failed"] for job in jobs), (name, jobs)
        for name, worker in workers.items():  # each loads its graphs from the cache the two children left
            cold = cold_compiles(worker)
            assert_close_to_eager(run_latent(worker, compiled, f"{name}-after"), eager, f"{name}, compiled")
            assert cold_compiles(worker) == cold, f"the {name} server compiled again what a child had compiled"
    assert_every_artifact_whole(sys.modules[accel_pack.__name__ + ".accel.cache.store"], tmp_path / "cache")
    # the killed server's job and child folders went with the restart's first job (its own are gone by its exit)
    left = [p.name for p in (tmp_path / "cache").glob("*/jobs/*") if f"-{killed}-" in p.name]
    assert not left, f"the killed server's background-compile folders stayed in the cache: {left}"


def interrupted(server, prompt_id: str, timeout: float = 600) -> list[str]:
    """Wait for the prompt to end; the names of ComfyUI's execution messages for it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = (server.get_json(f"/history/{prompt_id}").get(prompt_id) or {}).get("status", {})
        if status.get("completed") or status.get("status_str") == "error":
            return [name for name, _ in status.get("messages", [])]
        time.sleep(0.2)
    raise AssertionError(f"prompt {prompt_id} did not end:\n{server.log_tail()}")


def test_an_interrupt_during_a_compile_or_sampling_ends_only_that_prompt(tmp_path):
    in_path = replace(SD3, compiled=True, choose="always compiled", background=False)
    deepcache = replace(PLAIN, deepcache=2)
    with server_of(tmp_path / "server") as server:
        eager = run_latent(server, SD3, "eager")
        cached = run_latent(server, deepcache, "deepcache")

        # While a kind compiles in the prompt's path (the Compile Model node, "21", says the prompt waits).
        prompt_id = server.queue_prompt(graph_of(in_path, "interrupted-compile"))
        deadline = time.monotonic() + 120
        while "in the prompt's path" not in server.get_json("/accel/status").get("21", {}).get("text", ""):
            assert time.monotonic() < deadline, server.get_json("/accel/status")
            time.sleep(0.1)
        server.post_json("/interrupt", {})
        assert "execution_interrupted" in interrupted(server, prompt_id)
        assert_close_to_eager(run_latent(server, in_path, "after-compile"), eager, "after an interrupted compile")
        assert server.get_json("/accel/status")["21"]["state"] == "compiled"

        # While DeepCache samples: a long run, interrupted mid-way; its state must not reach the next run.
        prompt_id = server.queue_prompt(graph_of(replace(deepcache, steps=400), "interrupted-deepcache"))
        deadline = time.monotonic() + 120
        while not re.search(r"\b[1-9]\d*/400 \[", server.log_tail(400)):  # ComfyUI's progress bar: sampling
            assert time.monotonic() < deadline, f"the long prompt never sampled:\n{server.log_tail()}"
            time.sleep(0.2)
        server.post_json("/interrupt", {})
        assert "execution_interrupted" in interrupted(server, prompt_id)
        runs = [e for e in server.get_json("/accel/stats")["events"]
                if e["feature"] == "deepcache" and e["action"] == "run"]
        assert runs[-1]["status"] == "interrupted", runs[-1]
        assert torch.equal(run_latent(server, deepcache, "deepcache-after"), cached), "DeepCache's state leaked"
