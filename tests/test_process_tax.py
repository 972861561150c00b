"""The process tax (docs/process_tax.md, issue #68): a sampler-sized CPU allocation in ComfyUI's prompt thread must
not fault in fresh pages on every call. Each case runs in a fresh Python process (`python tests/test_process_tax.py
CASE`, below) so glibc's malloc state is that case's alone: thresholds frozen by a `mallopt`, a thread's heap
filled near its end, and the pack's real background compile and loading. Every count is getrusage's minor faults
and glibc's own chunk header of the real torch output; nothing is mocked.

The 2.5 MB `cat` is ComfyUI's `cond_cat` of a (1, 77, 4096) fp32 conditioning with its negative: 617 pages.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest

PAGES = 617  # of the cat's 2.5 MB output
FAULTS_BOUND = 8  # per call (median): a reused heap chunk takes 0-2 here
RESULT = "CASE_RESULT "
MALLOC_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", "ACCEL_MALLOC_TUNE")


def glibc_allocator() -> str | None:
    """Why these cases cannot run here, or None (Linux, glibc, glibc's malloc serving)."""
    version = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    if not sys.platform.startswith("linux") or not (version or "").startswith("glibc"):
        return "glibc is not the C library here"
    return None


needs_glibc = pytest.mark.skipif(glibc_allocator() is not None, reason=glibc_allocator() or "")


def run_case(case: str, timeout: float = 240, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in MALLOC_ENV}
    proc = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=timeout,
                          env={**clean, "OMP_NUM_THREADS": "1", **env}, cwd=ROOT, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    assert proc.returncode == 0 and lines, f"{case}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len(RESULT):])


# -- the cases (run by pytest) ------------------------------------------------------------------------------------

@needs_glibc
@pytest.mark.parametrize("switch", ["1", "0"])
def test_frozen_thresholds_then_compile_model_reuses_the_heap(switch):
    """T1. A library freezes glibc's mmap threshold at 128 KiB after torch is imported: every cat is a fresh mmap
    (617 faults). Compile Model applied through the real node on the small SD1.5 model, with ACCEL_MALLOC_TUNE=1,
    raises the thresholds: the prompt thread's cats then reuse heap memory (at most 8 faults a call, none
    mmapped). With the switch off the frozen state stays: it is real, and the tune is what removes it."""
    result = run_case("frozen", ACCEL_MALLOC_TUNE=switch)
    assert result["frozen"]["faults_median"] >= PAGES - 20 and result["frozen"]["mmapped"] == result["frozen"]["calls"]
    after = result["after_node"]
    if switch == "1":
        assert after["faults_median"] <= FAULTS_BOUND, after
        assert after["mmapped"] == 0, after
        assert result["tune"]["applied"], result["tune"]
        assert result["params_after"]["mmap_threshold"] >= 32 << 20, result["params_after"]
    else:
        assert not result["tune"]["applied"] and "ACCEL_MALLOC_TUNE" in result["tune"]["why_not"], result["tune"]
        assert after["faults_median"] >= PAGES - 20, after
        assert result["params_after"]["mmap_threshold"] == 128 << 10


@needs_glibc
@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_thread_heap_filled_near_its_end_keeps_its_outputs_with_the_tune(switch):
    """T2. The band: a thread's 64 MiB heap filled to within 1-2 MB of its end. Each 2.5 MB cat there makes a new
    heap that glibc deletes at once, and the output goes to main_arena (four system calls a call). With the tune
    (top pad 64 MiB) the outputs stay in the thread's own arena; without it they land in main_arena, which shows
    the band was reached."""
    result = run_case("band", ACCEL_MALLOC_TUNE=switch)
    assert result["filled_blocks"] > 8, result
    arenas = result["output_arenas"]
    if switch == "1":
        assert arenas == {result["thread_arena"]: result["calls"]}, result
    else:
        assert arenas.get("main", 0) >= result["calls"] - 2, result


@pytest.mark.full(why=(
    "the malloc thresholds around a real background compile; make test checks them around Compile Model "
    "in test_frozen_thresholds_then_compile_model_reuses_the_heap"))
@needs_glibc
def test_after_a_real_background_compile_and_loading_the_prompt_thread_pays_nothing(tmp_path):
    """T3. Compile Model's defaults on the generated LTX-Video model (one block kind, so one short child compile, as
    tests/background_probe.py; its conditioning is 4096 wide, as Flux's), sampled in a long-lived prompt-like
    thread: a child compiles its kind in the background and this process loads it. Before and after, glibc's thresholds stay
    dynamic (or tuned by the pack), are never lowered, the trim threshold stays at least the mmap threshold, and a
    cat in the prompt thread takes at most 8 faults a call more after than before. The pack's own allocation work
    ran on its one loader thread: the loads someone waited for, and the reading of the child's results; no
    per-job waiting thread was started. The per-step faults of the last sampling were recorded for the stats."""
    result = run_case("background", timeout=900, ACCEL_CACHE_DIR=str(tmp_path / "cache"))  # a new install's
    before, after = result["params_before"], result["params_after"]
    assert result["jobs"] and all(j["returncode"] == 0 and not j["failed"] for j in result["jobs"]), result["jobs"]
    assert after["dynamic"] or result["tune"]["applied"], (before, after)
    for name in ("mmap_threshold", "trim_threshold", "top_pad"):
        assert after[name] >= before[name], (name, before, after)
    assert after["trim_threshold"] >= after["mmap_threshold"], after
    assert result["cat_after"]["faults_median"] <= result["cat_before"]["faults_median"] + FAULTS_BOUND, result
    loads = result["load_threads"]
    assert loads and set(loads) == {"accel-loader"}, loads  # precompiled graphs loaded, all on the loader thread
    assert set(result["finish_threads"]) == {"accel-loader"}, result["finish_threads"]
    assert "accel-job-wait" not in result["thread_names_seen"], result["thread_names_seen"]
    steps = result["last_sampling_faults"]
    assert steps["by_step"] and steps["steps_counted"] == result["steps"] and steps["thread"] == "prompt", steps


@needs_glibc
def test_reader_agrees_with_mallinfo2_and_sees_mallopt_and_the_environment():
    """T4. glibc's live parameters read in place: MALLOC_TOP_PAD_ at start shows (and freezes the thresholds), a
    mallopt shows at once, and the mmap counters read beside them equal mallinfo2's as chunks come and go."""
    result = run_case("reader", MALLOC_TOP_PAD_=str(3 << 20))
    if result.get("skip"):
        pytest.skip(result["skip"])
    assert result["start"]["top_pad"] == 3 << 20 and not result["start"]["dynamic"], result["start"]
    assert result["after_mallopt"]["trim_threshold"] == 7 << 20, result["after_mallopt"]
    assert result["after_mallopt"]["mmap_threshold"] == 1 << 20, result["after_mallopt"]
    assert result["mmapped_while_held"] == result["mmapped_before"] + 3, result
    assert result["agreements"] == result["reads"], result
    assert result["chunk"] == {"held_mmapped": True, "small_mmapped": False, "small_arena": "main"}, result


@needs_glibc
def test_reader_and_tune_are_quiet_and_off_under_another_allocator():
    """jemalloc preloaded (where the machine has it): malloc is not glibc's, so glibc's settings are not tuned;
    the tune says why, and stays off too when the user set MALLOC_*_ variables."""
    result = run_case("refusals", MALLOC_TRIM_THRESHOLD_=str(64 << 20))
    assert "MALLOC_TRIM_THRESHOLD_" in result["env_reason"], result
    jemalloc = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib64/libjemalloc.so.2")
                     if Path(p).exists()), None)
    if jemalloc is None:
        pytest.skip("no libjemalloc.so.2 on this machine to preload")
    preloaded = run_case("refusals", LD_PRELOAD=jemalloc, ACCEL_MALLOC_TUNE="1")
    assert preloaded["allocator"]["mapped"] == [jemalloc] and preloaded["allocator"]["malloc_is_glibcs"] is False
    assert "another allocator serves malloc" in preloaded["env_reason"] and not preloaded["applied"], preloaded


def test_loader_thread_runs_handed_work_and_watches(accel_pack):
    """The pack's loader thread runs what it is handed (its result and exceptions come back to the caller) and
    calls a watched check until it says done: the job-wait of a background job, without a thread of its own."""
    loader = accel_pack.accel.compile.background.loader.LOADER
    assert loader.run_here(lambda: threading.current_thread().name) == "accel-loader"
    with pytest.raises(ZeroDivisionError):
        loader.run_here(lambda: 1 / 0)
    seen, done = [], threading.Event()

    def check() -> bool:
        seen.append(threading.current_thread().name)
        if len(seen) >= 3:
            done.set()
            return True
        return False

    loader.watch(check)
    assert done.wait(10) and set(seen) == {"accel-loader"}, seen
    assert loader.run_here(lambda: 42) == 42  # a nested run from the thread itself would run at once
    assert loader.run_here(lambda: loader.run_here(threading.current_thread).name) == "accel-loader"


@pytest.mark.server
def test_stats_show_the_last_samplings_faults_per_step(comfy_server):
    """GET /accel/stats: glibc's live settings and the minor faults of each step of the last sampling of a Compile
    Model model (the example workflow: 6 steps through KSampler, whose step callback counts them)."""
    from tools.comfy_server import load_workflow

    workflow = load_workflow("accel_txt2img_api.json")
    # Compile Model alone, its optional inputs' defaults written out: cache keys of their own in ComfyUI's output
    # cache, so no node of the example workflow stays cached for the next test on this server (test_server_e2e
    # counts that its nodes ran)
    del workflow["3"], workflow["10"]
    workflow["8"]["inputs"]["model"] = ["2", 0]
    workflow["11"]["inputs"]["vae"] = ["9", 0]
    workflow["2"]["inputs"].update(choose="auto", background=True)
    steps = workflow["8"]["inputs"]["steps"]
    comfy_server.run_workflow(workflow)
    found = comfy_server.get_json("/accel/stats")["malloc"]
    faults = found["last_sampling_faults"]
    assert faults["by_step"] and faults["steps_counted"] == steps == len(faults["per_step"]), faults
    assert all(isinstance(n, int) and n >= 0 for n in faults["per_step"]) and faults["whole_run"] >= 0, faults
    if glibc_allocator() is None:
        assert found["params"]["mmap_threshold"] > 0 and found["mallinfo2"]["heap_bytes"] > 0, found
        assert found["tune"]["applied"] is False and "ACCEL_MALLOC_TUNE" in found["tune"]["why_not"], found["tune"]


# -- the subprocess side ------------------------------------------------------------------------------------------

class PromptThread:
    """One long-lived thread running what it is handed, as ComfyUI's prompt worker runs prompts."""

    def __init__(self, name: str = "prompt"):
        import queue

        self._jobs, self._results = queue.Queue(), queue.Queue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self):
        while True:
            function = self._jobs.get()
            try:
                self._results.put((True, function()))
            except BaseException as err:  # noqa: BLE001  (raised in the caller)
                self._results.put((False, err))

    def call(self, function):
        self._jobs.put(function)
        ok, value = self._results.get()
        if not ok:
            raise value
        return value


def cats(malloc, calls: int, settle: int = 2) -> dict:
    """`calls` sampler-sized cats in this thread (after `settle` uncounted ones): faults per call and the output
    chunks' flags."""
    import resource

    import torch

    states = torch.zeros(1, 77, 4096)
    faults, mmapped, arenas = [], 0, {}
    for index in range(settle + calls):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = torch.cat([states, states], 1)
        taken = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
        chunk = malloc.chunk.tensor_chunk(out)
        del out
        if index >= settle:
            faults.append(taken)
            mmapped += bool(chunk.get("mmapped"))
            arena = str(chunk.get("arena"))
            arenas[arena] = arenas.get(arena, 0) + 1
    return {"calls": calls, "faults_median": statistics.median(faults), "faults_max": max(faults),
            "mmapped": mmapped, "arenas": arenas}


def libc():
    import ctypes

    handle = ctypes.CDLL("libc.so.6")
    handle.malloc.restype, handle.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    handle.free.argtypes = [ctypes.c_void_p]
    handle.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return handle


def pack_malloc(pack):
    """The pack's accel.malloc as ComfyUI loaded it, its modules imported (chunk.py is the tests' and the bench's)."""
    import importlib

    for name in ("chunk", "glibc", "tune", "step_faults"):
        importlib.import_module(f"{pack.accel.__name__}.malloc.{name}")
    return pack.accel.malloc


def case_frozen() -> dict:
    import torch

    torch.set_num_threads(1)
    libc().mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD, as a library's mallopt would, after torch's import
    from tools.comfy_env import load_pack

    pack = load_pack()
    import nodes

    malloc, prompt = pack_malloc(pack), PromptThread()
    frozen = prompt.call(lambda: cats(malloc, 10))

    def apply_node():
        (model,) = nodes.UNETLoader().load_unet("accel-sd15-small.safetensors", "default")
        return pack.nodes.compile_model.CompileModel().apply(model, "default", "auto", "auto")

    prompt.call(apply_node)
    return {"frozen": frozen, "after_node": prompt.call(lambda: cats(malloc, 30)),
            "tune": malloc.tune.TUNE.state, "params_after": malloc.glibc.params()}


def fill_heap_to_its_end(malloc, block: int = 1 << 20) -> list[int]:
    """In this thread: long-lived `block`s until one lands in a second heap of this thread's arena; that one and
    the block before it are freed, so the first heap is full except for 1-2 MB at its end (more than heap_trim
    keeps, less than the cat's 2.5 MB): the band. What long-lived allocations made in a thread leave by chance."""
    c, kept, first_heap = libc(), [], None
    for _ in range(200):
        pointer = c.malloc(block)
        heap = pointer & ~(malloc.chunk.HEAP_MAX - 1)
        first_heap = heap if first_heap is None else first_heap
        if heap != first_heap and not malloc.chunk.chunk_of(pointer)["main_arena"]:
            c.free(pointer)
            c.free(kept.pop())
            return kept
        kept.append(pointer)
    raise RuntimeError("no second heap after 200 MB")


def case_band() -> dict:
    import torch

    torch.set_num_threads(1)
    import accel.malloc.chunk
    import accel.malloc.glibc
    from accel.malloc import tune

    malloc = accel.malloc
    c = libc()
    big = c.malloc(24 << 20)  # what a model load does anyway: a freed 24 MB mmap raises the dynamic threshold
    c.free(big)
    state = tune.ensure_tuned()  # Compile Model's hook

    def in_thread():
        cats(malloc, 4, settle=0)
        kept = fill_heap_to_its_end(malloc)
        own = malloc.chunk.chunk_of(kept[-1])["arena"]
        found = cats(malloc, 20, settle=2)
        return {"filled_blocks": len(kept), "thread_arena": own, "output_arenas": found["arenas"],
                "calls": found["calls"], "faults_median": found["faults_median"]}

    return {**PromptThread("sampler").call(in_thread), "tune": state}


def case_background() -> dict:
    import logging

    import torch

    torch.set_num_threads(1)
    from tools.comfy_env import load_pack

    pack = load_pack(as_in_a_server=True)
    import nodes
    from tools.families import BY_FAMILY, load
    from tools.families import sample as family_sample

    family = BY_FAMILY["ltxv"]  # one block kind (one child compile), a 4096-wide conditioning as Flux's

    engine, malloc = pack.accel.compile, pack_malloc(pack)
    engine.kind_choice.FASTER_MARGIN = engine.auto_mode.WHOLE_CALL_MARGIN = 100.0  # paths kept whatever is timed
    records = []

    class Threads(logging.Handler):
        def emit(self, record):
            records.append((record.threadName, record.getMessage()))

    logging.getLogger("comfyui_accel").addHandler(Threads())
    logging.getLogger("comfyui_accel").setLevel(logging.INFO)
    seen_threads = set()
    steps = 3
    prompt = PromptThread()

    def sample(model):
        return family_sample(model, family, steps=steps,
                             callback=lambda *a: seen_threads.update(t.name for t in threading.enumerate()))

    params_before, cat_before = malloc.glibc.params(), prompt.call(lambda: cats(malloc, 20))

    def compile_and_sample():
        model = load(nodes, family)
        (compiled,) = pack.nodes.compile_model.CompileModel().apply(model, "default", "auto", "auto")
        sample(compiled)
        return compiled

    compiled = prompt.call(compile_and_sample)
    background = engine.background.BACKGROUND
    while background.compiling() or background.stats()["held_until_idle"]:  # a server between prompts
        seen_threads.update(t.name for t in threading.enumerate())
        threading.Event().wait(0.2)
    assert prompt.call(lambda: background.wait(timeout=600)), "the background compile did not finish"
    prompt.call(lambda: sample(compiled))
    return {"params_before": params_before, "params_after": malloc.glibc.params(), "cat_before": cat_before,
            "cat_after": prompt.call(lambda: cats(malloc, 20)), "tune": malloc.tune.TUNE.state,
            "jobs": background.stats()["finished"], "steps": steps,
            "load_threads": [t for t, m in records if "precompiled graphs (" in m and " loaded " in m],
            "finish_threads": [t for t, m in records if "background compile done" in m or
                               "background compile of" in m],
            "thread_names_seen": sorted(seen_threads), "last_sampling_faults": malloc.step_faults.STEP_FAULTS.last()}


def case_reader() -> dict:
    from accel.malloc import chunk
    from accel.malloc.glibc import mallinfo2, params

    start = params()
    if not start:
        return {"skip": "glibc's parameters could not be read here (no mallinfo2, or another layout)"}
    c = libc()
    c.mallopt(-1, 7 << 20)  # M_TRIM_THRESHOLD
    c.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    after = params()
    mmapped_before = mallinfo2()["mmapped_chunks"]
    held = [c.malloc(4 << 20) for _ in range(3)]  # above the threshold: one mmap each
    small = c.malloc(1000)
    flags = {"held_mmapped": chunk.chunk_of(held[0])["mmapped"], "small_mmapped": chunk.chunk_of(small)["mmapped"],
             "small_arena": chunk.chunk_of(small)["arena"]}
    mmapped_while_held = params()["mmapped_chunks"]
    reads = agreements = 0
    for pointer in held + [None]:  # 3, 2, 1 and 0 of them held
        mp, info = params(), mallinfo2()
        reads += 1
        agreements += bool(mp) and mp["mmapped_chunks"] == info["mmapped_chunks"] and \
            mp["mmapped_bytes"] == info["mmapped_bytes"] and mp["mmap_threshold"] == 1 << 20
        if pointer is not None:
            c.free(pointer)
    return {"start": start, "after_mallopt": after, "mmapped_before": mmapped_before,
            "mmapped_while_held": mmapped_while_held, "reads": reads, "agreements": agreements, "chunk": flags}


def case_refusals() -> dict:
    from accel.malloc import tune
    from accel.malloc.allocators import alternative_allocator

    state = tune.ensure_tuned()
    return {"env_reason": tune.reason_not_to_tune({**os.environ, "ACCEL_MALLOC_TUNE": "1"}),
            "applied": state["applied"], "allocator": alternative_allocator()}


if __name__ == "__main__":
    found = {"frozen": case_frozen, "band": case_band, "background": case_background, "reader": case_reader,
             "refusals": case_refusals}[sys.argv[1]]()
    print(RESULT + json.dumps(found, default=str), flush=True)
