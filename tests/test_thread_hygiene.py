"""Thread hygiene (#32, item 3): a thread of the pack's own that ran CPU kernels gives its OpenMP pool back, so the
sampler's thread is not left sharing the cores with an idle second pool (libgomp then stops its workers spinning
and every small parallel op of the sampler waits for them to wake: bench/loaded_vs_compiled.py measured a
sampler-sized fill_ at 70 us against 12 us before the preload thread did this).

Run in a fresh process with two torch threads: the test processes run with one (conftest.py), where no pool has
workers to count.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import torch
from accel.compile.background.openmp import release_this_threads_pool

def tasks():
    return len(os.listdir("/proc/self/task"))

def parallel_work():
    x = torch.randn(256, 256)
    (x @ x).sum()
    torch.randn(2_000_000).add_(1)  # large enough for ATen to go parallel

parallel_work()  # the main thread's own pool first
baseline = tasks()
ran, release, done = threading.Event(), threading.Event(), threading.Event()
released = []

def packs_thread(give_back):
    parallel_work()
    ran.set()
    release.wait()
    if give_back:
        released.append(release_this_threads_pool())
    done.set()
    time.sleep(30)  # stays alive, as the preload thread does

result = {"baseline": baseline, "threads": torch.get_num_threads()}
for give_back in (False, True):
    ran.clear(); release.clear(); done.clear()
    threading.Thread(target=packs_thread, args=(give_back,), daemon=True).start()
    ran.wait()
    with_pool = tasks()
    release.set(); done.wait(); time.sleep(0.2)
    result["kept" if not give_back else "given_back"] = {"with_pool": with_pool, "after": tasks()}
    baseline = tasks()  # the first thread (and its pool) stays: the second is counted on top of it
    result.setdefault("baselines", []).append(baseline)
result["released"] = released
print("RESULT " + json.dumps(result))
"""


def test_the_packs_thread_gives_its_openmp_pool_back():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["threads"] == 2, result
    kept, given_back = result["kept"], result["given_back"]
    # a thread that ran a parallel region holds a pool: itself and one worker on top of the baseline
    assert kept["with_pool"] == result["baseline"] + 2 and kept["after"] == kept["with_pool"], result
    # the same thread that gives its pool back keeps only itself
    assert result["released"] == [True], result
    assert given_back["with_pool"] == kept["after"] + 2 and given_back["after"] == kept["after"] + 1, result
