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


def test_doctor_reports_glibc_malloc_as_it_is():
    """The malloc section of the doctor's own process: glibc's live parameters, read in place and agreeing with
    mallinfo2 (the counters read beside the thresholds); the thresholds still glibc's dynamic ones; no mapped
    library imports mallopt or malloc_trim (torch's wheel and numpy do not); the tune off by default, saying so."""
    if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        pytest.skip("glibc is not the C library here: the section reads unknown")
    report = json.loads(accel_cli("doctor", "--json", "--seconds", "0.1").stdout)
    found = report["malloc"]
    assert found["glibc"] == os.confstr("CS_GNU_LIBC_VERSION").split()[1]
    mp = found["params"]
    assert mp and mp["dynamic"] and mp["mmap_threshold"] >= 128 << 10 and mp["trim_threshold"] >= 128 << 10, mp
    assert mp["mmapped_chunks"] >= 0 and found["mallinfo2"]["heap_bytes"] > 0, found
    assert found["allocator"] == {"mapped": [], "preloaded": [], "malloc_is_glibcs": True}, found["allocator"]
    assert found["importers"] == {} and found["warnings"] == [], found
    assert "ACCEL_MALLOC_TUNE" in (found["tune"]["why_not"] or "") or not found["tune"]["applied"], found["tune"]
    text = accel_cli("doctor", "--seconds", "0.1").stdout
    assert f"malloc: glibc {found['glibc']}" in text and "dynamic (glibc moves them itself)" in text, text


def test_doctor_warns_on_frozen_and_low_thresholds():
    """MALLOC_MMAP_THRESHOLD_ (as tests/test_soak.py runs ComfyUI) freezes glibc's thresholds at 128 KiB: the
    doctor reads them so and warns twice (every sampler-sized tensor mmapped; the trim threshold under the mmap
    threshold plus the top pad), and the tune would stay off for that variable."""
    if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        pytest.skip("glibc is not the C library here")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "ACCEL_MALLOC_TUNE": "1"}
    report = json.loads(accel_cli("doctor", "--json", "--seconds", "0.1", env=env).stdout)
    found = report["malloc"]
    assert found["params"]["mmap_threshold"] == 131072 and not found["params"]["dynamic"], found["params"]
    assert found["environment"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    warnings = "\n".join(report["warnings"])
    assert "mmap threshold is frozen at 128 KiB" in warnings and "trim threshold (" in warnings, warnings
    text = accel_cli("doctor", "--seconds", "0.1", env=env).stdout
    assert "off here (the environment tunes malloc already (MALLOC_MMAP_THRESHOLD_))" in text, text


def test_doctor_of_another_process_lists_its_malloc_importers_and_allocator():
    """--pid of a process that imported psutil (its C module imports malloc_trim) and, where the machine has
    jemalloc, runs with it preloaded: the doctor names both, read from that process's maps and environment."""
    jemalloc = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2")
                     if os.path.exists(p)), None)
    env = {**os.environ, **({"LD_PRELOAD": jemalloc} if jemalloc else {})}
    child = subprocess.Popen([sys.executable, "-c", "import sys, psutil; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        report = json.loads(accel_cli("doctor", "--pid", str(child.pid), "--json", "--seconds", "0.1").stdout)
    finally:
        child.communicate("", timeout=30)
    found = report["malloc"]
    assert found["params"] is None  # another process's memory: not read
    psutil_modules = [path for path in found["importers"] if "_psutil_linux" in path]
    assert psutil_modules and found["importers"][psutil_modules[0]] == ["malloc_trim"], found["importers"]
    if jemalloc:
        assert found["allocator"]["mapped"] == [jemalloc] and found["allocator"]["preloaded"] == [jemalloc]
        assert found["warnings"] == [], found["warnings"]  # glibc's state does not matter then
    else:
        assert any("_psutil_linux" in w and "malloc_trim" in w for w in found["warnings"]), found["warnings"]
