"""Giving back the OpenMP thread pool that one of the pack's threads opened, once its CPU work is done.

libgomp keeps one pool of worker threads per thread that ran a parallel region, and frees it only when that
thread exits. Once its threads outnumber the CPUs, every pool's idle workers stop spinning and sleep, so each
parallel region of the sampler's thread first has to wake its workers: on the 2-core test CPU a sampler-sized
`torch.cat` took 229 us against 78 us, a `fill_` 70 us against 12 us, and whole samplings 4.7% longer, in a
process whose preload thread (which lives as long as the process: preload.py) had replayed compiled blocks, against
one that had compiled them in its own thread (bench/loaded_vs_compiled.py, 2026-11-25). OpenMP 5's
`omp_pause_resource_all` frees the calling thread's pool (libgomp's `gomp_pause_host`) and leaves the thread
alive; a later parallel region in it makes a new pool. `ACCEL_RELEASE_OPENMP_POOLS=0` turns this off.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

log = logging.getLogger("comfyui_accel")

ENV = "ACCEL_RELEASE_OPENMP_POOLS"
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a new pool needs to start


def release_this_threads_pool() -> bool:
    """Free the OpenMP pool of the calling thread (never the sampler's: call it from the pack's own threads).
    False where it cannot: switched off, no single OpenMP runtime mapped, or one without the OpenMP 5 call."""
    if os.environ.get(ENV, "1") in ("0", ""):
        return False
    pause = _pause_call()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@functools.cache
def _pause_call():
    """`omp_pause_resource_all` of the one OpenMP runtime this process has mapped (torch's), opened without
    loading anything new (RTLD_NOLOAD); None when there is none, or several (which one a thread uses is then
    unclear: the doctor warns of it)."""
    from ...diagnostics import openmp_runtimes

    runtimes = openmp_runtimes(os.getpid())
    if len(runtimes) != 1:
        return None
    with contextlib.suppress(OSError, AttributeError):
        call = ctypes.CDLL(runtimes[0], mode=os.RTLD_NOLOAD).omp_pause_resource_all
        call.argtypes, call.restype = [ctypes.c_int], ctypes.c_int
        return call
    log.info("[Accel] %s has no omp_pause_resource_all: the preload thread keeps its OpenMP pool", runtimes[0])
    return None
