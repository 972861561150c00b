"""Cold compiles off the critical path: a child process compiles block kinds while their blocks run eagerly.

choose="auto": when a kind must be compiled and the persistent cache holds nothing for it, the sampler's call
goes on eagerly and one block of that kind is captured with its call's inputs. After the call, a child process
(`python -m accel compile-job DIR`, in the idle CPU scheduling class) compiles the captured kinds into the
persistent compile cache, the same way a compiled call here would. Meanwhile those blocks run eagerly. Once the
child is done, this process's next call compiles each kind again, which now reads torch's on-disk caches (a
fraction of a cold compile, docs/benchmarks/cold_start.md), and auto mode goes on as before: per-kind timing,
whole-call check.

The child gets a skeleton, never the user's weights: the block's module structure and attributes, with every
tensor replaced by its shape, strides, dtype, device and flags. Weights are graph inputs, so their values do not
change the compiled code; the child builds uninitialised tensors of the same layout. It runs with this process's
ComfyUI flags, torch thread count (inductor's CPU kernels are built for it) and grad mode, so its graphs are the
ones this process would compile. What cannot be captured (an attribute that does not pickle, a tensor subclass),
or a child that fails, sends the kind back to compiling here at its next call, and the log says why.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("comfyui_accel")

NICE_ENV = "ACCEL_BACKGROUND_NICE"  # set: the child runs at this niceness instead of the idle scheduling class
FALLBACK_NICE = 19  # where the idle class is not available
MAX_SKELETON_BYTES = 64 * 2**20  # a block's skeleton is kilobytes; more means it drags in something it should not
PACK_DIR = Path(__file__).resolve().parents[2]
# This module is `<pack>.accel.compile.background` inside ComfyUI and `accel.compile.background` in the child.
_PACK_PREFIX = __name__[: -len("compile.background")]


class CaptureError(ValueError):
    """A block or its inputs cannot be sent to the child process."""


# -- skeletons: module structure and tensor layouts, no tensor data -----------------------------------------
class _SkeletonPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) not in (torch.Tensor, torch.nn.Parameter):
                raise CaptureError(f"a tensor of type {type(obj).__name__} (only plain tensors are captured)")
            return ("tensor", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype).removeprefix("torch."),
                    str(obj.device), isinstance(obj, torch.nn.Parameter), obj.requires_grad, obj.is_inference())
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and module.startswith(_PACK_PREFIX) and hasattr(obj, "__qualname__"):
            # the pack's own functions (the SDPA override in a block's options) by name, whatever the pack's
            # module is called in this process
            return ("pack", module[len(_PACK_PREFIX):], obj.__qualname__)
        return None


class _SkeletonUnpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        if pid[0] == "pack":
            target = importlib.import_module(_PACK_PREFIX + pid[1])
            for name in pid[2].split("."):
                target = getattr(target, name)
            return target
        _, shape, stride, dtype, device, is_param, requires_grad, inference = pid
        with torch.inference_mode(inference):
            # Same layout, values never written: they do not reach the compiled code, and large allocations are
            # fresh pages that reading leaves unallocated (the kernel's shared zero page), so the child's memory
            # holds little of the blocks' weights. Not a view of a larger tensor: a view would have a _base.
            tensor = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
        if is_param:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def dump_skeleton(obj: Any) -> bytes:
    buffer = io.BytesIO()
    try:
        _SkeletonPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except CaptureError:
        raise
    except Exception as err:  # pickle's errors vary (PicklingError, TypeError, AttributeError)
        raise CaptureError(f"{type(err).__name__}: {str(err)[:200]}") from err
    if buffer.tell() > MAX_SKELETON_BYTES:
        raise CaptureError(f"its skeleton is {buffer.tell() >> 20} MiB, more than a block should hold")
    return buffer.getvalue()


def load_skeleton(data: bytes) -> Any:
    return _SkeletonUnpickler(io.BytesIO(data)).load()


# -- the parent's side -------------------------------------------------------------------------------------------
@dataclass
class Capture:
    """One block of a kind and the inputs of its compiled calls, taken during an eager call: one (args, kwargs)
    per distinct input signature, in call order (a kind can run at two resolutions in one UNet call; the child
    compiles them in the same order, so it makes the same static-then-dynamic graphs this process would)."""
    entry: Any  # registry.KindEntry
    block: torch.nn.Module
    attribute: str
    grad: bool
    inference: bool
    calls: list = field(default_factory=list)
    signatures: set = field(default_factory=set)

    def add_call(self, signature: tuple, args: tuple, kwargs: dict) -> None:
        if signature not in self.signatures:
            self.signatures.add(signature)
            self.calls.append((args, kwargs))


@dataclass
class Job:
    entries: list
    process: subprocess.Popen
    directory: Path
    started: float


class BackgroundCompiler:
    """One child at a time: kinds captured while one runs are sent (as skeletons) to the next, started when it
    ends. Their blocks run eagerly until then."""

    def __init__(self):
        self._lock = threading.Lock()
        self._job: Job | None = None
        self._queue: list[tuple[list[dict], list, Path]] = []  # (items, entries, environment dir) waiting
        self.history: list[dict] = []  # one record per finished job, for stats

    @property
    def busy(self) -> bool:
        return self._job is not None or bool(self._queue)

    def launch(self, captures: list[Capture], env_dir: Path) -> bool:
        """Send `captures` to a child (now, or when the running one ends): their kinds become "pending". False
        when none could be sent (each such kind compiles here at its next call instead, as logged)."""
        items, entries = [], []
        for capture in captures:
            try:
                items.append({"kind": [capture.entry.kind.class_name, capture.entry.kind.signature,
                                       capture.entry.kind.label],
                              "attribute": capture.attribute, "options": _options_dict(capture.entry.options),
                              "device": str(_device_of(capture)), "grad": capture.grad,
                              "inference": capture.inference,
                              "skeleton": dump_skeleton((capture.block, capture.calls))})
                entries.append(capture.entry)
            except Exception as err:  # CaptureError, or a block with no tensor to say its device
                capture.entry.background_failed(f"it cannot be sent to a child process ({err})")
        if not items:
            return False
        for entry in entries:
            entry.background = "pending"
        with self._lock:
            if self._job is not None:
                self._queue.append((items, entries, env_dir))
                return True
            return self._start(items, entries, env_dir)

    def _start(self, items: list[dict], entries: list, env_dir: Path) -> bool:
        """Start a child for `items` (the lock held)."""
        directory = env_dir / "jobs" / f"{os.getpid()}-{time.time_ns()}"
        try:
            setup = _child_setup(env_dir)
            directory.mkdir(parents=True)
            with open(directory / "job.pkl", "wb") as handle:
                pickle.dump({"items": items, "setup": setup}, handle)
            env = {**os.environ, "ACCEL_CACHE_DIR": str(env_dir.parent), "PYTHONUNBUFFERED": "1"}
            with open(directory / "log.txt", "wb") as log_file:  # the child keeps its own descriptor
                process = subprocess.Popen([sys.executable, "-m", "accel", "compile-job", str(directory)],
                                           cwd=PACK_DIR, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL)
        except Exception as err:  # whatever it is, it costs the background compile, never the prompt
            for entry in entries:
                entry.background_failed(f"the child process could not start ({err})")
            return False
        self._job = Job(entries, process, directory, time.perf_counter())
        log.info("[Accel] Compile Model: compiling %s in the background (pid %d); those blocks run eagerly until "
                 "it is done. ACCEL_DISABLE_BACKGROUND_COMPILE=1 compiles them at their first call instead.",
                 ", ".join(e.kind.label for e in entries), process.pid)
        return True

    def poll(self) -> None:
        """If the child has finished, hand its kinds back to the registry: cheap enough for every UNet call."""
        job = self._job
        if job is None or job.process.poll() is None:
            return
        with self._lock:
            if self._job is not job:
                return
            self._job = None
        self._finish(job)
        with self._lock:  # the next child, for kinds captured while this one ran
            while self._job is None and self._queue:
                self._start(*self._queue.pop(0))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every child (the running one and those queued) is done and its kinds are handed back;
        False on timeout."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while (job := self._job) is not None:
            try:
                job.process.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                return False
            self.poll()
        return True

    def _finish(self, job: Job) -> None:
        wall = time.perf_counter() - job.started
        results = _read_json(job.directory / "results.json") or {}
        by_id = {r["cache_id"]: r for r in results.get("kinds", [])}
        failed = []
        for entry in job.entries:
            result = by_id.get(entry.cache_id)
            if result and not result.get("failure"):  # compiled and saved, even if the child ended badly after
                entry.background_done(result["seconds"])
            else:
                why = (result or {}).get("failure") or f"the child exited with code {job.process.returncode}"
                entry.background_failed(why)
                failed.append(entry.kind.label)
        record = {"pid": job.process.pid, "kinds": [e.kind.label for e in job.entries], "wall_seconds": round(wall, 1),
                  "returncode": job.process.returncode, "peak_rss_mib": results.get("peak_rss_mib"),
                  "failed": failed}
        self.history.append(record)
        if failed:
            tail = (job.directory / "log.txt").read_text(errors="replace")[-2000:]
            log.warning("[Accel] Compile Model: the background compile of %s failed; they compile at their next "
                        "call instead. Its log (kept in %s) ends:\n%s", ", ".join(failed), job.directory, tail)
        else:
            shutil.rmtree(job.directory, ignore_errors=True)
            log.info("[Accel] Compile Model: background compile done in %.1f s (%s); the next call loads them from "
                     "the compile cache", wall, ", ".join(record["kinds"]))

    def stats(self) -> dict:
        self.poll()  # the server's stats route may ask while no UNet call comes to poll
        job = self._job
        running = None if job is None else {"pid": job.process.pid, "kinds": [e.kind.label for e in job.entries],
                                            "seconds": round(time.perf_counter() - job.started, 1)}
        queued = [e.kind.label for _, entries, _ in self._queue for e in entries]
        return {"running": running, "queued": queued, "finished": list(self.history)}


def _device_of(capture: Capture) -> torch.device:
    args, kwargs = capture.calls[0]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return next(capture.block.parameters()).device


def _options_dict(options) -> dict:
    return {**dataclasses.asdict(options), "choose": "always compiled", "background": False}


def _child_setup(env_dir: Path) -> dict:
    """What makes the child's compiled code the same as this process's: ComfyUI and its flags, torch threads."""
    import comfy.model_management  # `comfy` itself is a namespace package: no __file__
    from comfy.cli_args import args

    flags = {}
    for name, value in vars(args).items():
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(value)
            flags[name] = value
    return {"comfyui": str(Path(comfy.model_management.__file__).resolve().parent.parent), "flags": flags,
            "threads": torch.get_num_threads(), "parent": os.getpid(), "env_dir": str(env_dir)}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


BACKGROUND = BackgroundCompiler()


# -- the child's side: `python -m accel compile-job DIR` ----------------------------------------------------------
def _exit_with(parent: int) -> None:
    """A compile nobody will load is wasted CPU: on Linux the kernel ends this process when ComfyUI's ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(3)  # ComfyUI ended before this process could ask to end with it


def run_job(directory: Path) -> int:
    """Compile every captured kind of a job into the persistent cache; results.json says what happened."""
    _lower_priority()
    with open(directory / "job.pkl", "rb") as handle:
        job = pickle.load(handle)
    setup = job["setup"]
    _exit_with(setup["parent"])
    from ..comfy_import import import_comfyui_core

    flags = {k: v for k, v in setup["flags"].items() if k != "cpu"}
    import_comfyui_core(Path(setup["comfyui"]), setup["flags"].get("cpu", False), **flags)
    torch.set_num_threads(setup["threads"])
    from .blocks import BlockKind
    from .options import CompileOptions
    from .registry import REGISTRY

    results = []
    for item in job["items"]:
        if os.getppid() != setup["parent"]:
            return 3  # ComfyUI is gone: nobody will use what this compiles
        block, calls = load_skeleton(item["skeleton"])
        entry = REGISTRY.entry(BlockKind(*item["kind"]), getattr(type(block), item["attribute"]),
                               CompileOptions(**item["options"]), torch.device(item["device"]))
        start = time.perf_counter()
        with torch.inference_mode(item["inference"]), torch.set_grad_enabled(item["grad"]):
            for args, kwargs in calls:
                entry.run(block, lambda: (args, kwargs), args, kwargs, "always compiled")  # noqa: B023
        results.append({"cache_id": entry.cache_id, "kind": entry.kind.label, "failure": entry.failure,
                        "seconds": round(time.perf_counter() - start, 2), "compiles": entry.compiles})
        log.info("[Accel] background compile: %s in %.1f s%s", entry.kind.label, results[-1]["seconds"],
                 f" (failed: {entry.failure})" if entry.failure else "")
        from ..cache.store import write_atomic

        write_atomic(directory / "results.json",
                     json.dumps({"kinds": results, "peak_rss_mib": _peak_rss_mib()}, indent=1).encode())
    return 0


def _lower_priority() -> None:
    """The sampler keeps the CPU: on Linux the child (and the C++ compilers it starts, which inherit it) runs in
    the idle scheduling class, only on CPU time nothing else wants. A mere niceness still takes a share of a
    busy core, and torch's CPU threads wait for each other, so a share taken from one slows them all."""
    if NICE_ENV not in os.environ and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
    with contextlib.suppress(OSError, ValueError):
        os.nice(int(os.environ.get(NICE_ENV, FALLBACK_NICE)))


def _peak_rss_mib() -> int | None:
    """This process's own peak (VmHWM): getrusage's ru_maxrss would carry over the parent's peak across exec."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024)
    return None
