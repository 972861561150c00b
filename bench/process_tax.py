"""What Compile Model's defaults cost the rest of their process: plain eager's steady step before the node is applied
and after its background compile, in one process. At both points it also reads the process's threads and
children, a sampler-sized CPU `cat`/`fill_` (with the page faults a `cat` takes), the page faults of one eager
sampling and the main thread's context switches during one; after every timing, the CPU ops that took the
most time in one eager sampling (torch.profiler).

On one H200 (docs/benchmarks/gpu_h200.md) eager stepped at 20.5 ms before and 24.0 ms after, in a first version of
this probe; `make bench-gpu` runs it (its `tax` step). It uses the caches TORCHINDUCTOR_CACHE_DIR and
ACCEL_CACHE_DIR name, else empty ones of its own: then the node's first sampling is cold and its graphs come from
its own background child. (On the H200 a process that loaded its graphs paid the same as one that compiled them.)
- `--omp-passive`: the same with OMP_WAIT_POLICY=PASSIVE (OpenMP's idle threads sleep at once instead of
  spinning), to tell spinning pools apart.
- `--malloc-fixed`: with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, as tests/test_soak.py runs), to tell
  the allocator's moving threshold apart.
- `--malloc-diag`: instead of the timings above, the probe that tells which glibc mechanism it is
  (docs/process_tax.md): glibc's live malloc settings and totals at six points (torch and CUDA started, the model
  loaded, before Compile Model, its child done, its graphs loaded, the end); the sampler-sized `cat` in the main
  thread, a long-lived prompt thread started first and a new thread (faults, microseconds, output chunk mmapped
  or in which arena); minor faults and milliseconds per step of one eager sampling before the compile, after it
  and after the pack's malloc tune (ACCEL_MALLOC_TUNE), applied last in the same process; which mapped libraries
  import mallopt or malloc_trim; the price of a fresh page. On the CPU it rehearses in seconds with
  `--shape sd15 --model accel-sd15-small.safetensors` and ACCEL_DISABLE_COMPILE=1 (tests/test_bench_gpu.py).

    python bench/process_tax.py [--model accel-tiny-flux-bench.safetensors] [--latent 128] [--steps 8]
                                [--omp-passive | --malloc-fixed | --malloc-diag [--shape flux|sd15]]
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.child import cache_env, print_result
from tools.harness.sampling import conditioning, sample
from tools.harness.variants import load_unet, variant_model, wait_for_background

TICKS = os.sysconf("SC_CLK_TCK")
# Each option: the environment it re-runs this script with (read once, when the process starts the library)
REEXEC = {"omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "malloc_fixed": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def thread_cpu() -> dict[str, tuple[str, int]]:
    """Per thread of this process: (name, CPU ticks so far); Python's name where the thread is Python's."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat, open(f"/proc/self/task/{tid}/comm") as comm:
                fields = stat.read().rsplit(")", 1)[1].split()
                found[tid] = (names.get(tid, comm.read().strip()), int(fields[11]) + int(fields[12]))
        except OSError:  # the thread ended meanwhile
            pass
    return found


def busy_threads(run, samplings: int = 6) -> dict:
    """The threads' CPU use, in cores, over `samplings` runs of `run` (those above 1% of a core)."""
    before, start = thread_cpu(), time.perf_counter()
    for _ in range(samplings):
        run()
    wall, after = time.perf_counter() - start, thread_cpu()
    used = sorted(((after[t][0], round((after[t][1] - before[t][1]) / TICKS / wall, 3)) for t in after
                   if t in before), key=lambda row: -row[1])
    return {"threads": len(after), "busy": [row for row in used if row[1] > 0.01]}


def cpu_ops(latent: int) -> dict:
    """Median and 90th percentile microseconds of a sampler-sized CPU `cat` (a new output each time) and `fill_`,
    and the median microseconds of a torch call on an 8-element tensor."""
    import torch

    states, latent_buffer, found = torch.zeros(1, 77, 4096), torch.empty(1, 16, latent, latent), {}
    for name, op in (("cat", lambda: torch.cat([states, states], 1)), ("fill", lambda: latent_buffer.fill_(1.0))):
        times, faults = [], minor_faults()
        for _ in range(200):
            start = time.perf_counter()
            op()
            times.append((time.perf_counter() - start) * 1e6)
        times.sort()
        found[f"{name}_us"], found[f"{name}_p90_us"] = statistics.median(times), times[179]
        found[f"{name}_faults"] = (minor_faults() - faults) / 200  # a new output's pages, each faulted in
    small = torch.ones(8)
    per_op = []
    for _ in range(50):  # what Python pays per torch call: what a launch-bound GPU step is made of
        start = time.perf_counter()
        for _ in range(200):
            small.add(1.0)
        per_op.append((time.perf_counter() - start) / 200 * 1e6)
    found["small_op_us"] = statistics.median(per_op)
    return found


def minor_faults() -> int:
    with open("/proc/self/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def main_thread_switches(run) -> dict:
    """The main thread's voluntary (it waited) and involuntary (it was preempted) context switches over `run()`."""
    def read() -> dict:
        with open(f"/proc/self/task/{threading.main_thread().native_id}/status") as status:
            return {k: int(v) for k, v in (line.split(":") for line in status if "ctxt_switches" in line)}

    before = read()
    run()
    return {k: v - before[k] for k, v in read().items()}


def top_cpu_ops(run, count: int = 8) -> list:
    """(op, self CPU ms, calls) of the ops that took the most CPU time in `run()`, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:count]
    return [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in events]


def children() -> list[str]:
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append(" ".join(child.cmdline()[:4])[-70:])
        except psutil.Error:  # ended, or a zombie not yet reaped
            found.append(f"pid {child.pid} (ended)")
    return found


class PromptThread:
    """A long-lived thread running what it is handed, as ComfyUI's prompt worker: its glibc arena lives as long."""

    def __init__(self):
        import queue

        self._jobs, self._results = queue.Queue(), queue.Queue()
        threading.Thread(target=self._serve, name="prompt", daemon=True).start()

    def _serve(self):
        while True:
            self._results.put(self._jobs.get()())

    def call(self, function):
        self._jobs.put(function)
        return self._results.get()


def in_new_thread(function):
    box = []
    thread = threading.Thread(target=lambda: box.append(function()), name="new")
    thread.start()
    thread.join()
    return box[0]


def cat_probe(calls: int = 30) -> dict:
    """The sampler-sized cat in the calling thread: faults and microseconds per call (medians, after 2), and where
    the outputs' chunks were (mmapped, or the arena)."""
    import torch

    from accel.malloc.chunk import tensor_chunk

    states, faults, times, where = torch.zeros(1, 77, 4096), [], [], {}
    for index in range(calls + 2):
        f0, t0 = minor_faults(), time.perf_counter()
        out = torch.cat([states, states], 1)
        elapsed, taken = (time.perf_counter() - t0) * 1e6, minor_faults() - f0
        chunk = tensor_chunk(out)
        del out
        if index >= 2:
            faults.append(taken)
            times.append(elapsed)
            key = "mmapped" if chunk.get("mmapped") else str(chunk.get("arena"))
            where[key] = where.get(key, 0) + 1
    return {"faults": statistics.median(faults), "faults_max": max(faults), "us": round(statistics.median(times), 1),
            "chunks": where}


def fault_price(mib: int = 32) -> float:
    """Median microseconds a fresh page costs now (the VM's side of the tax), touched in 2.5 MB pieces."""
    import mmap

    piece, region, costs = PAGE_PIECE, mmap.mmap(-1, mib << 20), []
    for base in range(0, (mib << 20) - piece, piece):
        f0, t0 = minor_faults(), time.perf_counter()
        for offset in range(base, base + piece, 4096):
            region[offset] = 1
        costs.append((time.perf_counter() - t0) / max(minor_faults() - f0, 1) * 1e6)
    region.close()
    return round(statistics.median(costs), 2)


PAGE_PIECE = 617 * 4096


def malloc_diag(args) -> None:
    import torch

    from accel.malloc.allocators import alternative_allocator
    from accel.malloc.glibc import glibc_version, mallinfo2, params
    from accel.malloc.importers import malloc_importers

    prompt = PromptThread()  # before anything else: ComfyUI's prompt thread lives from the server's start
    prompt.call(lambda: torch.zeros(1).add_(1))  # it has an arena (and torch's per-thread state) from here
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
    points = {}

    def point(name: str) -> None:
        points[name] = {"params": params(), "mallinfo2": mallinfo2(), "process_faults": minor_faults()}

    def cats() -> dict:
        return {"main": cat_probe(), "prompt": prompt.call(cat_probe), "new_thread": in_new_thread(cat_probe)}

    point("torch_started")
    base = load_unet(args.model, cpu=not cuda)
    point("model_loaded")
    width, channels, pooled = (768, 4, False) if args.shape == "sd15" else (4096, 16, True)
    conds, shape = conditioning(width, 77, pooled=pooled), (1, channels, args.latent, args.latent)

    def eager_steps() -> dict:
        """One eager sampling in the prompt thread: minor faults (process) and milliseconds of each step."""
        import comfy.sample

        def run():
            marks = [(minor_faults(), time.perf_counter())]
            latent = torch.zeros(shape)
            comfy.sample.sample(base, comfy.sample.prepare_noise(latent, 0), args.steps, 1.0, "euler", "normal",
                                *conds, latent, disable_pbar=True, seed=0,
                                callback=lambda *a: marks.append((minor_faults(), time.perf_counter())))
            return {"faults": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
                    "ms": [round((b[1] - a[1]) * 1e3, 2) for a, b in zip(marks, marks[1:])]}

        prompt.call(run)  # the first sampling settles the thresholds
        return prompt.call(run)

    result = {"glibc": glibc_version(), "allocator": alternative_allocator(),
              "env": {k: v for k, v in os.environ.items()
                      if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD", "ACCEL_MALLOC_TUNE")},
              "fault_price_us_before": fault_price(), "cats_before": cats(), "eager_before": eager_steps()}
    point("before_compile")
    model, engine = variant_model("accel", base)
    prompt.call(lambda: sample(model, conds, shape, args.steps, 1.0))
    compiler = engine.background.BACKGROUND
    while compiler.compiling():
        time.sleep(0.1)
    point("child_done")
    result["background"] = wait_for_background(engine)
    point("graphs_loaded")
    result.update(cats_after=cats(), eager_after=eager_steps(), fault_price_us_after=fault_price())
    tune = sys.modules[engine.__name__.rsplit(".", 1)[0] + ".malloc.tune"]
    # the tune, last: what it changes in this same process. Compile Model decided it already with the
    # environment's switch (applied where ACCEL_MALLOC_TUNE=1): a fresh decision with the switch on, which never
    # lowers what is there, applies it now where it may be
    result["tune_when_applied"] = dict(tune.TUNE.state)
    os.environ[tune.SWITCH] = "1"
    result["tune"] = tune.MallocTune().apply_once()
    result.update(cats_tuned=cats(), eager_tuned=eager_steps())
    point("end")
    result.update(points=points, importers=malloc_importers())
    print_result(result, default=str)


def main() -> None:
    parser = cli.parser(__doc__, model=FLUX_BENCH.file_name, latent=128, steps=8)
    parser.add_argument("--omp-passive", action="store_true", help="run with OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--malloc-fixed", action="store_true", help="run with MALLOC_MMAP_THRESHOLD_=131072")
    parser.add_argument("--malloc-diag", action="store_true", help="glibc malloc's state and faults (see above)")
    parser.add_argument("--shape", choices=("flux", "sd15"), default="flux",
                        help="--malloc-diag: the model's conditioning and latent (sd15: the CPU rehearsal's)")
    args = parser.parse_args()
    if args.steps < 2:  # each steady time leaves out its sampling's first step
        parser.error(f"--steps {args.steps}: use 2 or more (steady times leave out each sampling's first step)")
    for option, env in REEXEC.items():
        if getattr(args, option) and any(os.environ.get(k) != v for k, v in env.items()):
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    if not {"TORCHINDUCTOR_CACHE_DIR", "ACCEL_CACHE_DIR"} <= set(os.environ):
        os.environ.update(cache_env(Path(tempfile.mkdtemp(prefix="accel-bench-tax-")), {}))
    if args.malloc_diag:
        return malloc_diag(args)
    import torch

    base = load_unet(args.model, cpu=not torch.cuda.is_available())
    conds = conditioning(4096, 77, pooled=True)

    def run(model):
        return sample(model, conds, (1, 16, args.latent, args.latent), args.steps, 1.0)

    def steady_ms(model, samplings: int = 4) -> float:
        return statistics.median(sum((run(model).step_s[1:] for _ in range(samplings)), [])) * 1e3

    def probes(model) -> dict:
        faults = minor_faults()
        run(model)  # Python's own allocator maps and unmaps memory too: a sampling's faults, whatever made them
        return {"sampling_faults": minor_faults() - faults, "switches": main_thread_switches(lambda: run(model))}

    run(base), run(base)
    result = {"omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
              "before": {"eager_ms": steady_ms(base), **cpu_ops(args.latent), **busy_threads(lambda: run(base)),
                         **probes(base)}}
    model, engine = variant_model("accel", base)
    run(model)
    result["background"] = wait_for_background(engine)
    run(model), run(model)
    after = {"children": children()}
    for round_ in range(2):  # interleaved: a drift of the machine falls on both
        after[f"eager_ms_{round_}"], after[f"defaults_ms_{round_}"] = steady_ms(base), steady_ms(model)
    after.update(cpu_ops(args.latent))
    after.update(probes(base))
    after["eager_busy"], after["defaults_busy"] = busy_threads(lambda: run(base)), busy_threads(lambda: run(model))
    after["python_threads"] = [t.name for t in threading.enumerate()]
    # Last, after every timing: whatever the profiler leaves behind in this process cannot weigh on them
    after["top_cpu_ops"] = top_cpu_ops(lambda: run(base))
    result["after"] = after
    result["eager_after_vs_before"] = statistics.mean([after["eager_ms_0"], after["eager_ms_1"]]) / \
        result["before"]["eager_ms"]
    print_result(result, default=str)


if __name__ == "__main__":
    main()
