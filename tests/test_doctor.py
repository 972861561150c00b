"""`python -m accel doctor`: threads, OpenMP runtimes, affinity and thread settings, read from /proc of a real
process with the real torch (nothing mocked); and the command line's help, which lists only user commands."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from tools.comfy_env import ROOT


def accel_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "accel", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_doctor_json_of_its_own_process():
    """The torch wheel ships one libgomp, and nothing else the doctor imports maps another runtime; the
    OMP_NUM_THREADS it was started with shows in its environment section and in torch's count."""
    report = json.loads(accel_cli("doctor", "--json", "--seconds", "0.1",
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
    assert len(report["openmp_runtimes"]) == 1 and "gomp" in report["openmp_runtimes"][0], report["openmp_runtimes"]
    assert report["threads"] >= 1 and report["threads"] == len(report["per_thread"])
    assert report["torch"]["num_threads"] == 1 and report["torch"]["num_threads_in_new_thread"] == 1
    assert any("parallel backend" in line for line in report["torch"]["parallel_info"])
    assert report["environment"]["OMP_NUM_THREADS"] == "1"
    assert report["affinity"]["allowed_cpus"] and report["affinity"]["cpu_count"] >= 1
    assert report["warnings"] == [], report["warnings"]
    assert isinstance(report["busy_threads"], list)


def test_report_sees_a_second_threads_openmp_pool():
    """A thread that runs torch ops gets an OpenMP pool of its own (libgomp keeps one per thread that starts a
    parallel region, until that thread ends): the report lists the thread and at least its count - 1 more."""
    import torch

    from accel.diagnostics import thread_report

    before = {t["tid"] for t in thread_report()["per_thread"]}
    worked, finish, seen = threading.Event(), threading.Event(), {}

    def work():
        seen["tid"], seen["num_threads"] = threading.get_native_id(), torch.get_num_threads()
        a = torch.randn(256, 256)
        (a @ a).sum()
        torch.randn(1 << 20).add(1).sum()  # above ATen's grain size: a parallel region on any BLAS
        worked.set()
        finish.wait(60)

    worker = threading.Thread(target=work, name="doctor-test-worker")
    worker.start()
    try:
        assert worked.wait(60)
        report = thread_report()
    finally:
        finish.set()
        worker.join()
    tids = {t["tid"] for t in report["per_thread"]}
    assert seen["tid"] in tids
    assert len(tids - before) >= seen["num_threads"], (before, report["per_thread"])
    assert report["threads"] == len(report["per_thread"]) > len(before & tids)
    assert report["torch"]["num_threads_in_new_thread"] == seen["num_threads"]


def test_doctor_of_another_process():
    """--pid: that process's threads and runtimes (this test process has torch loaded), without a torch section."""
    import torch  # noqa: F401  (loaded here already by conftest's header; imported so the runtime is surely mapped)

    report = json.loads(accel_cli("doctor", "--pid", str(os.getpid()), "--json", "--seconds", "0.1").stdout)
    assert report["pid"] == os.getpid() and report["torch"] is None
    assert any("gomp" in path for path in report["openmp_runtimes"])
    assert os.getpid() in {t["tid"] for t in report["per_thread"]}
    text = accel_cli("doctor", "--pid", str(os.getpid()), "--seconds", "0.1").stdout
    assert "torch: not shown for another process" in text


def test_doctor_says_what_it_could_not_read_of_another_process():
    """A ComfyUI of another user, or in a container: /proc/N/maps refused. Before, its runtimes read as "none
    loaded" and the report found no problem; now a warning says what is unknown and how to see it."""
    try:
        with open("/proc/1/maps", "rb") as f:
            f.read(1)
        pytest.skip("this machine lets the test read /proc/1/maps: nothing is refused to show")
    except PermissionError:
        pass
    report = json.loads(accel_cli("doctor", "--pid", "1", "--json", "--seconds", "0.1").stdout)
    assert any("could not read /proc/1/maps" in w and "unknown, not none" in w for w in report["warnings"]), report


def test_help_lists_only_user_commands():
    text = accel_cli("--help").stdout
    assert "SUPPRESS" not in text and "compile-worker" not in text
    for command in ("precompile", "cache", "doctor"):
        assert command in text
    assert "usage: python -m accel compile-worker" in accel_cli("compile-worker", "--help").stdout


POOL_SCRIPT = """
import json, threading, torch
from accel.diagnostics import thread_report
from accel.thread_names import start_thread

ready, finish = threading.Barrier(3), threading.Event()

def waits():  # what the pack's threads do: wait, read files, hand results back
    ready.wait(); finish.wait(60)

def computes():  # what they must not do: a CPU kernel above ATen's grain size opens this thread's OpenMP pool
    torch.randn(1 << 20).add(1).sum()
    ready.wait(); finish.wait(60)

start_thread("accel-waits", waits)
start_thread("accel-computes", computes)
ready.wait()
report = thread_report()
finish.set()
print(json.dumps({"pools": report["pack_thread_pools"], "warnings": report["warnings"],
                  "names": [t["name"] for t in report["per_thread"]], "num_threads": torch.get_num_threads()}))
"""


def test_a_pack_threads_openmp_pool_is_told_apart_from_the_samplers():
    """The pack's threads carry their names natively (accel/thread_names.py), so the OpenMP pool one of them opens
    by running a CPU kernel carries its name too: the report counts it against that thread (and warns), and
    counts nothing against a thread of the pack that only waits. Two OpenMP threads: with one, no pool starts."""
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert seen["num_threads"] == 2
    assert {"accel-waits", "accel-computes"} <= set(seen["names"]), seen["names"]
    assert seen["pools"] == {"accel-computes": 1}, seen
    assert any("accel-computes started 1 native threads" in text for text in seen["warnings"]), seen["warnings"]
