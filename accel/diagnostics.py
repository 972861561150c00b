"""Thread and OpenMP hygiene of a process, for `python -m accel doctor` and the "threads" of GET /accel/stats;
the doctor adds the C allocator's state (doctor_report, malloc/report.py).

CPU inference slows down for reasons invisible from inside torch: two OpenMP runtimes mapped into one process
(each with its own spinning pool: pytorch#98836), an affinity mask narrower than torch's thread count
(pytorch#125547), an OMP_NUM_THREADS that torch no longer follows, or a thread whose torch count differs from the
main thread's (ATen initialises its OpenMP count per thread). Everything here reads /proc (Linux); elsewhere the
/proc parts come back empty, so the stats route still answers on Windows and macOS.
"""
from __future__ import annotations

import os
import re
import threading
import time

from .malloc.importers import mapped_libraries
from .thread_names import PREFIX as PACK_THREAD_PREFIX

# libgomp.so.1 (GCC, conda), libgomp-a34b3233.so.1 (a wheel's copy renamed by auditwheel), libiomp5.so (Intel),
# libomp.so.5 (LLVM); the separator keeps libomptarget (LLVM's offloading plugin, not a runtime) out.
OPENMP_RUNTIME = re.compile(r"lib(?:gomp|iomp5|omp)(?:-[0-9A-Za-z]+)?\.so")
ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_")
ENV_NAMES = ("TORCHINDUCTOR_COMPILE_THREADS",)


def openmp_runtimes(pid: int) -> list[str]:
    """The OpenMP runtime libraries mapped into pid, one path each (a library maps several segments; none where
    there is no /proc, or the process is gone)."""
    return [path for path in mapped_libraries(pid) if OPENMP_RUNTIME.match(os.path.basename(path))]


def thread_times(pid: int) -> list[dict]:
    """Each thread of pid: tid, name, cpu seconds so far and the CPUs it may run on."""
    threads = []
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:  # no /proc: not Linux (Windows has no os.sysconf either)
        return threads
    ticks = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:  # a thread may end between the listing and the reads: it is left out then
            with open(f"{base}/stat") as f:
                stat = f.read()
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/status") as f:
                allowed = next((line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list")),
                               None)
        except OSError:
            continue
        # the name in stat is in parentheses and may hold spaces or ")": fields are counted after the last ")";
        # there utime and stime are fields 14 and 15 of proc(5), i.e. the 12th and 13th after the name
        rest = stat[stat.rindex(")") + 2:].split()
        threads.append({"tid": int(tid), "name": name, "cpu_seconds": (int(rest[11]) + int(rest[12])) / ticks,
                        "cpus_allowed": allowed})
    return threads


def busy_threads(seconds: float = 1.0, pid: int | None = None) -> list[dict]:
    """The threads of pid that used the CPU over the next `seconds`, with their share of one core, busiest first.
    It sleeps: the stats route does not call it."""
    pid = pid or os.getpid()
    before = {t["tid"]: t["cpu_seconds"] for t in thread_times(pid)}
    start = time.monotonic()
    time.sleep(seconds)
    after = thread_times(pid)
    elapsed = time.monotonic() - start
    busy = [{"tid": t["tid"], "name": t["name"],
             "core_share": round((t["cpu_seconds"] - before.get(t["tid"], 0.0)) / elapsed, 3)} for t in after]
    return sorted((b for b in busy if b["core_share"] > 0), key=lambda b: b["core_share"], reverse=True)


def torch_threads() -> dict:
    """torch's view of threads, from this process only (another process's torch cannot be asked)."""
    import torch  # lazy: the pack's import stays cheap; here torch is wanted (the doctor, a running server)

    info = torch.__config__.parallel_info().splitlines()
    # what comes before the environment list (counts, OpenMP and MKL versions), and the backend line at its end
    head = [line.strip() for line in info[:next((i for i, text in enumerate(info) if text.startswith("Environment")),
                                                 len(info))]]
    head += [line.strip() for line in info if "parallel backend" in line]
    seen = []
    # ATen sets a thread's OpenMP count when that thread first uses it, so a worker thread (ComfyUI's prompt
    # worker, a background compile) may run with another count than this one: a fresh thread shows which
    probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()), name="accel-doctor-probe")
    probe.start()
    probe.join()
    return {"version": torch.__version__, "num_threads": torch.get_num_threads(),
            "num_interop_threads": torch.get_num_interop_threads(),
            "num_threads_in_new_thread": seen[0] if seen else None, "parallel_info": [text for text in head if text]}


def process_environment(pid: int) -> dict | None:
    """pid's environment: this process's now, another's as it started (what it set itself later is not visible),
    None where it may not be read."""
    if pid == os.getpid():
        return dict(os.environ)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.decode(errors="replace").partition("=") for item in f.read().split(b"\0") if item]
    except OSError:
        return None
    return {name: value for name, _, value in pairs}


def environment(pid: int) -> dict:
    env = process_environment(pid) or {}
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def doctor_report(pid: int | None = None) -> dict:
    """The doctor's report: threads (thread_report) and the C allocator (malloc/report.py), its warnings joined
    to the threads' ones."""
    from .malloc.report import malloc_report

    report = thread_report(pid)
    report["malloc"] = malloc_report(report["pid"], process_environment(report["pid"]) or {})
    report["warnings"] = report["warnings"] + report["malloc"]["warnings"]
    return report


def thread_report(pid: int | None = None) -> dict:
    """Threads, OpenMP runtimes, affinity and thread settings of this process (or pid), with warnings for the
    known causes of slow CPU inference. The torch section is this process's only."""
    own = pid is None or pid == os.getpid()
    pid = os.getpid() if pid is None else pid
    # torch first: its import maps libgomp and its probe thread has ended before the threads are listed
    torch_info = torch_threads() if own else None
    python_threads = {t.native_id for t in threading.enumerate()}
    per_thread = thread_times(pid)
    python_threads |= {t.native_id for t in threading.enumerate()}  # and those started during the listing
    pools = pools_of_pack_threads(per_thread, python_threads) if own else None
    if pools:  # or a thread of the pack that had just ended (or begun) as Python saw it, not yet as Linux did
        time.sleep(PROC_SETTLE_SECONDS)
        python_threads |= {t.native_id for t in threading.enumerate()}
        still = {t["tid"] for t in thread_times(pid)}
        pools = pools_of_pack_threads([t for t in per_thread if t["tid"] in still], python_threads)
    allowed = sorted(os.sched_getaffinity(pid)) if hasattr(os, "sched_getaffinity") else None
    report = {"pid": pid, "openmp_runtimes": openmp_runtimes(pid), "threads": len(per_thread),
              "per_thread": per_thread, "torch": torch_info, "pack_thread_pools": pools,
              "affinity": {"allowed_cpus": allowed, "cpu_count": os.cpu_count()}, "environment": environment(pid),
              "unreadable": [] if own else unreadable(pid)}
    report["warnings"] = problems(report)
    return report


def unreadable(pid: int) -> list[str]:
    """The files of another process's /proc the report reads and may not (a ComfyUI of another user, or in a
    container): without them its runtimes and settings would read as none, a clean bill it did not earn."""
    refused = []
    for name in ("maps", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                f.read(1)
        except PermissionError:
            refused.append(f"/proc/{pid}/{name}")
        except OSError:
            pass  # gone, or no /proc: nothing to say about access
    return refused


# A pool's threads live as long as the process; a thread Python has just let go of is gone from /proc within
# milliseconds. The stats' threads section once counted such a thread as a pool (a server test, 2026-11-27: a
# job's waiting thread seen in one poll of many); a second look this much later tells them apart.
PROC_SETTLE_SECONDS = 0.05


def pools_of_pack_threads(per_thread: list[dict], python_threads: set[int]) -> dict[str, int]:
    """Per thread of the pack (by its native name), the native threads it started: an OpenMP pool (or torch's
    inter-op threads) opened because that thread ran CPU kernels. None is expected: the pack's threads wait,
    load and deserialise; a pool of theirs spins beside the sampler's (thread_names.py says how they are seen)."""
    found: dict[str, int] = {}
    for thread in per_thread:
        if thread["name"].startswith(PACK_THREAD_PREFIX) and thread["tid"] not in python_threads:
            found[thread["name"]] = found.get(thread["name"], 0) + 1
    return found


def problems(report: dict) -> list[str]:
    """The report's "warnings": human sentences, each naming the cause and its effect."""
    said = []
    runtimes, torch_info, allowed = report["openmp_runtimes"], report["torch"], report["affinity"]["allowed_cpus"]
    if report.get("unreadable"):
        said.append(f"could not read {' and '.join(report['unreadable'])} (permission denied): its OpenMP runtimes "
                    "and thread settings are unknown, not none; run the doctor as the user that runs ComfyUI, in "
                    "its container")
    if len(runtimes) > 1:
        said.append(f"{len(runtimes)} OpenMP runtimes are loaded ({', '.join(runtimes)}): each keeps its own thread "
                    "pool, and together they can oversubscribe the cores and slow CPU work (pytorch#98836)")
    for name, count in (report.get("pack_thread_pools") or {}).items():
        said.append(f"the pack's thread {name} started {count} native threads (an OpenMP pool): it ran CPU kernels "
                    "outside ComfyUI's prompt thread, and that pool's threads compete with the sampler's")
    if torch_info is None:
        return said
    threads = torch_info["num_threads"]
    if allowed is not None and len(allowed) < threads:
        said.append(f"torch uses {threads} threads but the process may run on only {len(allowed)} CPUs "
                    f"(affinity {allowed}): threads share cores and wait on each other (pytorch#125547)")
    omp = report["environment"].get("OMP_NUM_THREADS")
    if omp is not None and omp.strip() != str(threads):
        said.append(f"OMP_NUM_THREADS is {omp!r} but torch uses {threads} threads (torch.set_num_threads changed it, "
                    "or the variable was set after torch started)")
    fresh = torch_info["num_threads_in_new_thread"]
    if fresh is not None and fresh != threads:
        said.append(f"a new thread's torch thread count is {fresh}, this thread's is {threads}: work run in other "
                    "threads (ComfyUI's prompt worker) uses a different count")
    return said
