"""Every check only a GPU can show, in one command (`make bench-gpu`): on a machine with an NVIDIA GPU, the steps
of STEPS, each in processes of its own (the existing benchmarks, called with arguments), within one shared time
budget (10 minutes), written to docs/benchmarks/gpu.md. Without a GPU it says so and exits 0, writing nothing;
`--dry-run` prints the plan (each step's commands and time budget) on any machine. Exit 1 when a check failed.
`--only flux,comfyui-0.33` runs those steps alone (a second call of the same lease).

    python bench/gpu.py [--dry-run] [--budget 600] [--only STEP,...] [--out docs/benchmarks/gpu.md]

The ComfyUI 0.33 step runs on a second ComfyUI beside the one under test: the one tools/gpu_bundle.sh unpacked
(ACCEL_GPU_COMFYUI_033 and ACCEL_GPU_SITE_033), else the one `make setup COMFYUI=0.33.0` made, else this one
when it is 0.33 or later.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import RELEASES, ROOT, comfyui_dir, comfyui_version
from tools.families import FAMILIES
from tools.family_models import FLUX_BENCH
from tools.harness import cli
from tools.harness.child import PREFIX, cache_env
from tools.harness.machine import gpu_machine_lines
from tools.harness.results import markdown_table

NO_GPU = ("no CUDA GPU on this machine: nothing to run (bench/gpu.py checks only what a GPU can show; run it on a "
          "GPU machine)")
PY = sys.executable
# Largest |compiled - eager| over eager's largest value, per dtype ComfyUI picked. Measured on one H100
# (docs/benchmarks/gpu_h100.md; torch 2.11.0+cu130, ComfyUI 0.3.75): the fp16 families 5e-4 to 4.1e-3 (SDXL
# always compiled), the bf16 ones 4.6e-3 to 1.5e-2 (Lumina 2): Inductor fuses and reorders half-precision sums.
TOLERANCE = {"torch.float16": 5e-3, "torch.bfloat16": 2e-2, "torch.float32": 1e-3}  # fp32: the CPU tests' rtol
# The families run two to a process, the processes at once (errors, not speeds, are their result): one after
# another, the background children's waits alone summed to 307 s on the H100 (gpu_h100.md), half the budget.
# Neighbours in tools/families.py share a process: Wan 2.2 reuses Wan 2.1's compiled kind there, as on the H100.
FAMILIES_PER_PROCESS = 2
NAMES = [family.name for family in FAMILIES]
# The benchmark Flux at 1024x1024 pixels, as in gpu_h100.md
FLUX = ["--family", "flux", "--latent", "128", "--steps", "8"]
# Loaded/compiled steady step. gpu_h100.md's open problem: 20 ms against 16.3 ms, process-wide (eager in the
# same process slowed too, so the ratio paired with eager would hide it).
LOADED_BOUND = 1.10
# Plain eager, timed in each variant's process (the `paired` samplings), against eager's own process: what the
# variant costs the rest of the process. The H200 run (gpu_h200.md) found the defaults' process 1.29x slower at
# eager steps, core's 1.01x.
TAX_BOUND = 1.10
FLUX_VARIANTS = "eager,core,accel,accel-compiled,accel-graphs"  # accel-graphs: the defaults with CUDA graphs
checks: list[tuple[str, str]] = []  # (PASS, FAIL or SKIPPED, what)


def check(ok: bool, what: str, state: str | None = None) -> str:
    checks.append((state or ("PASS" if ok else "FAIL"), what))
    return f"{checks[-1][0]}: {what}"


def f(value, spec: str = ".3g", unit: str = "") -> str:
    return "" if value is None else format(value, spec) + unit


def json_lines(text: str) -> list[dict]:
    """The JSON objects a benchmark printed one a line (`RESULT {...}`, or a parent's per-variant lines)."""
    found = []
    for line in (line.removeprefix(PREFIX).strip() for line in text.splitlines()):
        if line.startswith("{") and line.endswith("}"):
            with suppress(ValueError):
                found.append(json.loads(line))
    return found


def spent(run: dict) -> bool:  # stopped by the budget, not failed: a check it could not make is SKIPPED
    return bool(run.get("not_run") or run["timed_out"])


def failure(run: dict) -> str | None:
    if run.get("not_run") or run["timed_out"]:
        return "not run: the step's time was spent" if run.get("not_run") else f"timed out after {run['seconds']:.0f} s"
    return f"exit {run['rc']}: " + " / ".join(run["stderr"].strip().splitlines()[-3:])[-600:] if run["rc"] else None


def models_step(runs: list[dict]) -> list[str]:
    why = failure(runs[0])
    return [check(why is None, f"the benchmark Flux {FLUX_BENCH.file_name} is there" + (f" ({why})" if why else "")),
            *(line for line in runs[0]["stdout"].splitlines() if line.startswith("[models]"))]


def doctor_step(runs: list[dict]) -> list[str]:
    try:  # another change adds the command: until it is there, a note, not a failure
        r = json.loads(runs[0]["stdout"])
    except ValueError:
        return [check(False, "thread diagnostic: `python -m accel doctor --json` is not there yet or failed "
                             f"({failure(runs[0]) or 'no JSON printed'})", "SKIPPED")]
    t = r.get("torch") or {}
    return [f"- {r['threads']} threads on {len(r['affinity']['allowed_cpus'])} of {r['affinity']['cpu_count']} CPUs; "
            f"OpenMP runtimes: {', '.join(r['openmp_runtimes']) or 'none'}; torch: {t.get('num_threads')} threads, "
            f"{t.get('num_interop_threads')} inter-op; environment: {r['environment'] or 'no thread settings'}",
            *(f"- warning: {w}" for w in r["warnings"] or ["none: no known thread problem found"])]


def families_step(runs: list[dict]) -> list[str]:
    results = {r["family"]: r for run in runs for r in json_lines(run["stdout"]) if "family" in r}
    process_of = {name: run for run in runs for name in run["cmd"][run["cmd"].index("--families") + 1].split(",")}
    rows = []
    for name in NAMES:
        if (r := results.get(name)) is None or "failed" in r:  # failed in the script, or its process ended first
            run = process_of[name]
            check(False, f"family {name}: {r['failed'][:300] if r else failure(run) or 'no result printed'}",
                  "SKIPPED" if r is None and spent(run) else "FAIL")
            rows.append([name, *[""] * 8, f"{checks[-1][0]} (see Checks)"])
            continue
        error = max(r[k] for k in ("auto_first_error", "auto_loading_error", "auto_error", "always_error"))
        tol = TOLERANCE.get(r["dtype"], 0.0)
        check(error <= tol and r["repeat_compiles"] == 0, f"{name} ({r['dtype']}): largest error {error:.2g} "
              f"(tolerance {tol:g}), {r['repeat_compiles']} compiles on the repeat, the defaults' first sampling "
              f"{'equals' if r['auto_first_error'] == 0 else 'differs from'} eager's")
        paths = ", ".join(f"{k['kind']}={k['path']}" for k in r["auto_kinds"])
        rows.append([name, r["dtype"].removeprefix("torch."), "x".join(map(str, r["latent"])), f"{error:.2g}",
                     f"{tol:g}", r["repeat_compiles"], f"{f(r['eager_first_s'])} / {f(r['auto_first_s'])} s",
                     f(r["background_wait_s"], unit=" s"),
                     f"{paths} ({', '.join(c['verdict'] for c in r['whole_call_checks'])})", checks[-1][0]])
    return [*markdown_table("family,dtype,latent,largest error,tolerance,compiles on repeat,first sampling: eager / "
                            "defaults,child's wait,auto mode's paths (verdicts),result".split(","), rows),
            "", f"{len(runs)} processes at once: their samplings and waits share the CPU and the GPU, so they say "
            "what works and what a compile costs, not a speed."]


def flux_step(runs: list[dict]) -> list[str]:
    saved = ROOT / "bench" / "results" / "compile_flux.json"  # the parent's report: errors against eager, ratios
    fresh = saved.exists() and saved.stat().st_mtime >= runs[0]["started_at"]
    report = json.loads(saved.read_text()) if fresh else {"results": json_lines(runs[0]["stdout"])}
    tol, rows = TOLERANCE["torch.float16"], []  # fp16: ComfyUI's pick for Flux on the H100 (gpu_h100.md)
    for r in report["results"]:
        bg, p = r.get("background") or {}, r["paired"]
        first, steady = r.get("max_rel_error_vs_eager_first"), r.get("max_rel_error_vs_eager_steady")
        repeats = r["compiles_in_repeated_prompt_length_sweep"] + r["compiles_in_repeated_size_sweep"]
        rows.append([r["variant"], f(r["cold_first_sample_s"], unit=" s"),
                     f"{bg['wait_after_first_sampling_s']:.3g} / {bg['loading_sampling_s']:.3g} s" if bg else "",
                     f(r["steady_s_per_step"] * 1e3, ".1f"), f(r.get("kernel_ms_per_step"), ".1f"),
                     f"{p['s_per_step'] * 1e3:.1f}, "
                     f"{p['eager_s_per_step'] * 1e3:.1f}, {p['vs_eager']:.3f}",
                     f(r.get("peak_gpu_allocated_mib"), ".0f", " MiB"), f(r["peak_rss_sampling_mib"], ".0f", " MiB"),
                     f"{r['compiles_in_prompt_length_sweep']} / {r['compiles_in_size_sweep']}, {repeats}",
                     f"{f(first, '.2g')} / {f(steady, '.2g')}"])
        if r["variant"] != "eager" and steady is not None:
            check(max(first, steady) <= tol and repeats == 0, f"Flux {r['variant']}: error {max(first, steady):.2g} "
                  f"(fp16 tolerance {tol:g}), {repeats} compiles on the sweeps' repeats")
    taxes = process_taxes(report["results"])
    for variant, tax in taxes.items():
        check(tax <= TAX_BOUND, f"Flux {variant}: plain eager steps {tax:.3f}x as long in its process as in eager's "
              f"(bound {TAX_BOUND})")
    for variant in sorted(set(FLUX_VARIANTS.split(",")) - {r["variant"] for r in report["results"]}):
        check(False, f"Flux {variant} did not finish: {failure(runs[0])}", "SKIPPED" if spent(runs[0]) else None)
    return [*markdown_table("variant,cold first sampling,child's wait / loading sampling,steady ms/step,GPU kernels "
                            "ms/step,paired with eager (interleaved rounds, medians): ms/step / eager's / ratio,peak "
                            "GPU allocated,peak RSS,compiles in prompt-length / size sweeps; on their repeats,error vs "
                            "eager: first / steady".split(","), rows),
            "", *(f"- {k}: {v:.3g}" for k, v in report.get("ratios", {}).items()),
            *(f"- plain eager's step in the {v} process / in eager's: {t:.3f}" for v, t in taxes.items()),
            *speed_targets({r["variant"]: r for r in report["results"]}),
            *(f"- {r['variant']}: CUDA graphs per kind {r['accel_graphs']}" for r in report["results"]
              if r.get("accel_graphs")),
            "- GPU kernels: the device's busy time in one steady sampling (torch.profiler, kernels, copies and "
            "fills), per step; the rest of a step's wall time is launch and host work."]


def speed_targets(by: dict) -> list[str]:
    """Issue 68's targets, as measured (lines, not checks: they say where the pack stands)."""
    eager = by.get("eager", {}).get("steady_s_per_step")
    lines = []
    for name, target in (("core", None), ("accel", "at least 1.24x, core's"), ("accel-compiled", None),
                         ("accel-graphs", "at least 1.4x where graphs pay")):
        steady = by.get(name, {}).get("steady_s_per_step")
        if eager and steady:
            lines.append(f"- {name}: {eager / steady:.3f}x eager's speed (steady step)"
                         + (f"; target {target}" if target else ""))
    return lines


def process_taxes(results: list[dict]) -> dict[str, float]:
    """Per variant: plain eager's paired step in its process over eager's in the eager process (1.0: the variant
    slows nothing else)."""
    own = next((r["paired"]["eager_s_per_step"] for r in results if r["variant"] == "eager"), None)
    return {} if own is None else {r["variant"]: r["paired"]["eager_s_per_step"] / own
                                   for r in results if r["variant"] != "eager"}


def malloc_diag_lines(r: dict) -> list[str]:
    """bench/process_tax.py --malloc-diag's report (docs/process_tax.md says how to read it): glibc's settings at
    the six points, the 2.5 MB cat's faults in three threads and eager's faults and ms per step, before the
    defaults' background compile, after it, and after the pack's tune in the same process."""
    def settings(params: dict | None) -> str:
        if not params:
            return "unread"
        return (f"{'dynamic' if params.get('dynamic') else 'FROZEN'}, mmap {params.get('mmap_threshold')}, trim "
                f"{params.get('trim_threshold')}, top pad {params.get('top_pad')}")

    def cat(c: dict) -> str:
        return f"{c.get('faults_median')} faults, {c.get('us_median')} us, chunks {c.get('chunks')}"

    lines = [f"- glibc {r.get('glibc')}; another allocator: {r.get('allocator')}; malloc environment: "
             f"{r.get('env') or 'none'}; libraries importing mallopt/malloc_trim: {r.get('importers') or 'none'}; "
             f"a fresh page's price (us) before {r.get('fault_price_us_before')}, after "
             f"{r.get('fault_price_us_after')}"]
    lines += [f"- glibc's settings at {name}: {settings(point.get('params'))}" for name, point in r["points"].items()]
    for when in ("before", "after", "tuned"):
        cats, eager = r.get(f"cats_{when}", {}), r.get(f"eager_{when}", {})
        lines.append(f"- {when}: eager faults per step {eager.get('faults')}, ms per step {eager.get('ms')}; the "
                     "cat in " + "; ".join(f"{thread}: {cat(c)}" for thread, c in cats.items()))
    return lines


def tax_step(runs: list[dict]) -> list[str]:
    rows, switches, diag = [], [], []
    for run in runs:
        if not (found := json_lines(run["stdout"])):
            check(False, f"process tax ({shlex.join(run['cmd'][1:])}): {failure(run) or 'no RESULT line'}",
                  "SKIPPED" if spent(run) else None)
            continue
        if "points" in found[0]:  # the malloc probe: a readout, not a bound
            diag = ["", "**glibc malloc** (`bench/process_tax.py --malloc-diag`, the benchmark Flux's shape):",
                    *malloc_diag_lines(found[0])]
            continue
        r, after = found[0], found[0]["after"]
        tax, passive = r["eager_after_vs_before"], r["omp_env"].get("OMP_WAIT_POLICY") == "PASSIVE"
        check(tax <= TAX_BOUND, f"plain eager after the defaults' background compile steps {tax:.3f}x as long as "
              f"before it, in one process{' (OMP_WAIT_POLICY=PASSIVE)' * passive}"
              f"{' (MALLOC_MMAP_THRESHOLD_ fixed)' * bool(r['malloc_env'])} (bound {TAX_BOUND})")
        switches.append(f"- process {len(rows) + 1}: one eager sampling's page faults before "
                        f"{r['before']['sampling_faults']}, after {after['sampling_faults']}; the main thread's "
                        f"context switches in one, before {r['before']['switches']}, after {after['switches']}; the "
                        f"CPU ops with the most self time in one after (op, ms, calls): {after['top_cpu_ops'][:5]}")
        rows.append([", ".join(f"{k}={v}" for k, v in {**r["omp_env"], **r["malloc_env"]}.items()) or "as it is",
                     f(r["before"]["eager_ms"], ".1f"), f"{after['eager_ms_0']:.1f}, {after['eager_ms_1']:.1f}",
                     f"{after['defaults_ms_0']:.1f}, {after['defaults_ms_1']:.1f}", f"{tax:.3f}",
                     f"{r['before']['cat_us']:.0f} / {r['before']['cat_p90_us']:.0f}; {r['before']['cat_faults']:.0f}",
                     f"{after['cat_us']:.0f} / {after['cat_p90_us']:.0f}; {after['cat_faults']:.0f}",
                     f"{r['before']['small_op_us']:.2f} -> {after['small_op_us']:.2f}",
                     f"{r['before']['threads']} / {after['eager_busy']['threads']}", checks[-1][0]])
    return [*markdown_table("environment,eager before (ms/step),eager after (two rounds),the defaults after,"
                            "eager after / before,CPU cat before: median / p90 (us); page faults a cat,after,"
                            "a torch call on 8 elements (us),threads before / after,result".split(","), rows),
            "", *switches, *diag,
            "", "The processes share one cache: the first compiles in its background child, the others load. "
                "The full output (busy threads, children) is in the log."]


def cache_step(runs: list[dict]) -> list[str]:
    if not all(results := [json_lines(run["stdout"]) for run in runs]):
        why = next((failure(run) for run in runs if failure(run)), "no RESULT line")
        return [check(False, f"the compiling and the loading process: {why}", "SKIPPED" if spent(runs[-1]) else None)]
    (made,), (loaded,) = results
    rows = [[label, f(r["cold_first_sample_s"], unit=" s"), r["compiles_first_run"],
             f(r["steady_s_per_step"] * 1e3, ".1f"), f"{r['paired']['s_per_step'] * 1e3:.1f}, "
             f"{r['paired']['eager_s_per_step'] * 1e3:.1f}, {r['paired']['vs_eager']:.3f}"]
            for label, r in (("compiled (empty caches)", made), ("loaded (the first one's caches)", loaded))]
    steady = loaded["steady_s_per_step"] / made["steady_s_per_step"]
    paired = loaded["paired"]["vs_eager"] / made["paired"]["vs_eager"]
    return [*markdown_table("process,cold first sampling,compiles in it,steady ms/step,paired: ms/step / eager's / "
                            "ratio".split(","), rows),
            "", f"- loaded / compiled: steady step {steady:.3f}, paired with eager {paired:.3f}",
            "- " + check(steady <= LOADED_BOUND, f"the process that loaded from the cache steps within "
                         f"{LOADED_BOUND}x of the one that compiled ({steady:.3f}x)")]


def comfyui_at_least(version: tuple[int, int]) -> bool:
    try:
        return tuple(int(part) for part in comfyui_version().split(".")[:2]) >= version
    except (OSError, ValueError):  # no ComfyUI set up
        return False


@dataclass(frozen=True)
class OtherComfyUI:
    """A second ComfyUI to run a step's commands on: its Python, the environment that points the project at it,
    and why there is none (then the step is a note)."""
    python: str = PY
    env: dict | None = None
    missing: str | None = None


def comfyui_033() -> OtherComfyUI:
    """ComfyUI 0.33 for its step: unpacked by tools/gpu_bundle.sh, else set up by `make setup COMFYUI=0.33.0`,
    else the ComfyUI under test if it is 0.33 or later."""
    bundled, site = os.environ.get("ACCEL_GPU_COMFYUI_033"), os.environ.get("ACCEL_GPU_SITE_033")
    if bundled:
        path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
        return OtherComfyUI(PY, {"COMFYUI_DIR": bundled, "ACCEL_COMFYUI": "0.33.0", "PYTHONPATH": path})
    if comfyui_at_least((0, 33)):
        return OtherComfyUI()
    release = RELEASES["0.33.0"]
    python = ROOT / release["venv"] / "bin" / "python"
    if (release["folder"] / "main.py").exists() and python.exists():
        return OtherComfyUI(str(python), {"COMFYUI_DIR": str(release["folder"]), "ACCEL_COMFYUI": "0.33.0"})
    return OtherComfyUI(missing=f"no ComfyUI 0.33 here: the one under test is {comfyui_version()}, and neither "
                                f"tools/gpu_bundle.sh's nor `make setup COMFYUI=0.33.0`'s ({release['folder']}) is")


# The benchmark Flux's file, linked into the other ComfyUI's models folder (the models step wrote it here).
LINK_MODEL = ("import os, sys; from pathlib import Path; from tools.comfy_env import comfyui_dir; "
              "src = Path(sys.argv[1]); dst = comfyui_dir() / 'models' / 'diffusion_models' / src.name; "
              "dst.exists() or os.symlink(src, dst); print('[models]', dst, '->', src)")


def comfyui_033_commands(scratch: str) -> list[list[str]]:
    other = comfyui_033()
    if other.missing:
        return []
    flux = comfyui_dir() / "models" / "diffusion_models" / FLUX_BENCH.file_name
    return [[other.python, "-c", LINK_MODEL, str(flux)],
            *([other.python, "bench/dynamic_vram.py", "--vram", vram, "--latent", "128", "--steps", "8",
               "--rounds", "3"] for vram in ("dynamic", "disabled"))]


def comfyui_033_step(runs: list[dict]) -> list[str]:
    rows, lines = [], []
    for run in runs[1:]:
        if not (found := json_lines(run["stdout"])):
            check(False, f"ComfyUI 0.33, {shlex.join(run['cmd'][2:])}: {failure(run) or 'no RESULT line'}",
                  "SKIPPED" if spent(run) else None)
            continue
        r = found[0]
        mode = "dynamic VRAM" if r["dynamic_vram"] else f"without dynamic VRAM ({r['why_not'] or 'disabled'})"
        lines.append(f"- `--vram {r['vram']}`: ComfyUI {r['comfyui']}, {mode}; the loaded model is a "
                     f"{r['patcher']} (dynamic: {r['is_dynamic']})")
        tol = TOLERANCE["torch.float16"]
        for name, v in r["variants"].items():
            rows.append([r["vram"], name, v["is_dynamic"], f(v["first_sampling_s"], unit=" s"),
                         f(v.get("child_wait_s"), unit=" s"), f(v["steady_ms_per_step"], ".1f"),
                         f(v.get("peak_device_used_mib"), ".0f", " MiB"), f(v.get("peak_torch_allocated_mib"), ".0f",
                                                                            " MiB"),
                         f"{f(v.get('first_error_vs_eager'), '.2g')} / {f(v.get('error_vs_eager'), '.2g')}",
                         ", ".join(f"{k}={p}" for k, p in v.get("paths", {}).items())])
            if name != "eager" and v.get("error_vs_eager") is not None:
                error = max(v["error_vs_eager"], v["first_error_vs_eager"])
                check(error <= tol, f"ComfyUI 0.33 ({r['vram']}) {name}: error {error:.2g} (fp16 tolerance {tol:g})")
        eager, accel, core = (r["variants"].get(n, {}).get("steady_ms_per_step") for n in ("eager", "accel", "core"))
        if eager and accel and core:
            lines.append(f"  - the defaults' steady step against the faster of eager and core: "
                         f"{min(eager, core) / accel:.3f}x (target at least 1)")
        peak_e, peak_a = (r["variants"].get(n, {}).get("peak_device_used_mib") for n in ("eager", "accel"))
        if peak_e and peak_a:
            lines.append(f"  - the defaults' peak VRAM over eager's: {peak_a / peak_e:.3f}x (target at most 1.05 "
                         "with dynamic VRAM)")
    return [*markdown_table("--vram,variant,model dynamic,first sampling,child's wait,steady ms/step (interleaved "
                            "rounds, medians),peak device used,peak torch allocated,error vs eager: first / settled,"
                            "auto mode's paths".split(","), rows),
            "", *lines, "", "Each VRAM mode in one process, on empty caches of its own. Flux on 0.33.0 has no core "
            "block CUDA graphs (comfy/ldm/flux/model.py never calls comfy.model_prefetch), so eager with dynamic "
            "VRAM is what a default NVIDIA install runs."]


@dataclass
class Step:
    name: str
    title: str
    budget_s: int  # at most this much of the shared budget
    commands: Callable[[str], list[list[str]]]  # given a scratch folder; [] when there is nothing to run
    report: Callable[[list[dict]], list[str]] | None = None  # the commands' outcomes -> the doc's lines
    note: Callable[[], str] = str  # why nothing runs, when commands gives none
    parallel: bool = False  # its commands at once
    shared_cache: bool = False  # its commands share one TORCHINDUCTOR_CACHE_DIR and ACCEL_CACHE_DIR
    own_caches: bool = False  # each command on empty caches of its own
    env: Callable[[], dict | None] = lambda: None  # more environment for its commands (another ComfyUI)


# The order is the priority: a budget spent by the earlier steps leaves the later ones SKIPPED, said so. From the
# H200 run of 2026-11-26 (gpu_h200.md) and the probes' own estimates: models 17 s, doctor 4 s, flux 206 s with four
# variants (about 260 s with five), tax about 110 s, families 102 s, cache 60 s; the 0.33 step about 150 s (not
# run yet). That is over 540 s: the cache step, already measured at 1.019x, goes last, and `--only` reruns any.
STEPS = [
    Step("models", "The benchmark Flux's file (generated when missing)", 60, lambda s: [
        [PY, "tools/make_models.py", "--set", "full", "--only", FLUX_BENCH.file_name]], models_step),
    Step("doctor", "Thread diagnostic", 20, lambda s: [[PY, "-m", "accel", "doctor", "--json"]], doctor_step),
    Step("lowvram", "Partial loading (lowvram)", 0, lambda s: [],
         note=lambda: "not measured by this script yet: bench/compile_model.py and bench/compile_families.py take no "
                      "ComfyUI flags (they set only `cpu`), so ComfyUI's `--lowvram` cannot reach them; on the CPU "
                      "tests/test_compile_flux.py checks a half-loaded Flux's output."),
    Step("flux", "The benchmark Flux at 1024x1024: eager, core, the defaults, always compiled, with CUDA graphs", 280,
         lambda s: [[PY, "bench/compile_model.py", *FLUX, "--variants", FLUX_VARIANTS]], flux_step),
    # One cache: the first process compiles in its child, the other two load (62 s against about 35 s a process on
    # the H200, where loading and compiling processes paid the same tax).
    # The malloc probe (--malloc-diag) takes the place of the run with glibc's threshold frozen low (--malloc-fixed):
    # it reads glibc's state and the faults at six points, and eager before and after the pack's tune, in one process
    Step("tax", "What the defaults cost the rest of their process", 220, lambda s: [
        [PY, "bench/process_tax.py"], [PY, "bench/process_tax.py", "--omp-passive"],
        [PY, "bench/process_tax.py", "--malloc-diag"]], tax_step, shared_cache=True),
    Step("comfyui-0.33", "ComfyUI 0.33: the benchmark Flux with and without dynamic VRAM", 200,
         comfyui_033_commands, comfyui_033_step, own_caches=True, env=lambda: comfyui_033().env,
         note=lambda: f"not measured: {comfyui_033().missing}"),
    Step("families", "Every family at fp16/bf16 against its tolerance", 150, lambda s: [
        [PY, "bench/compile_families.py", "--families", ",".join(NAMES[i:i + FAMILIES_PER_PROCESS]), "--scale", "4",
         "--steps", "4"] for i in range(0, len(NAMES), FAMILIES_PER_PROCESS)], families_step, parallel=True),
    Step("cache", "A process that loaded from the cache against one that compiled", 120, lambda s: [
        [PY, "bench/compile_model.py", "--child", "accel", *FLUX, "--outputs", s]] * 2, cache_step,
         shared_cache=True),
]


def run_step(step: Step, end: float) -> list[dict]:
    """The step's commands, one after another or at once, each in a session of its own that is killed whole (its
    compile workers, background children) when it ends or at `end`; output goes to files (a full pipe would
    stall a process nobody reads yet)."""
    with tempfile.TemporaryDirectory(prefix=f"accel-gpu-{step.name}-") as scratch:
        env = {**(cache_env(Path(scratch)) if step.shared_cache else os.environ), **(step.env() or {})}

        def launch(number: int, cmd: list[str]) -> dict:
            files = [open(f"{scratch}/{number}.{kind}", "w+") for kind in ("out", "err")]  # noqa: SIM115
            own = cache_env(Path(scratch) / str(number), env) if step.own_caches else env
            proc = subprocess.Popen(cmd, cwd=ROOT, env=own, text=True, start_new_session=True, stdout=files[0],
                                    stderr=files[1])
            return {"cmd": cmd, "shown": show(cmd, step, scratch), "proc": proc, "files": files,
                    "start": time.monotonic(), "started_at": time.time()}

        def finish(run: dict) -> dict:
            proc, run["timed_out"] = run.pop("proc"), False
            try:
                proc.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                run["timed_out"] = True
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for name, file in zip(("stdout", "stderr"), run.pop("files")):
                file.seek(0)
                run[name] = file.read()
                file.close()
            return run | {"rc": proc.wait(), "seconds": time.monotonic() - run["start"]}

        commands = step.commands(scratch)
        if step.parallel:
            return [finish(run) for run in [launch(n, cmd) for n, cmd in enumerate(commands)]]
        return [finish(launch(n, cmd)) if time.monotonic() < end else
                {"cmd": cmd, "shown": show(cmd, step, scratch), "not_run": True, "stdout": ""}
                for n, cmd in enumerate(commands)]


def show(cmd: list[str], step: Step, scratch: str) -> str:
    cache = "TORCHINDUCTOR_CACHE_DIR=$SCRATCH/torch ACCEL_CACHE_DIR=$SCRATCH/accel " if step.shared_cache else ""
    cache = "TORCHINDUCTOR_CACHE_DIR=$SCRATCH/N/torch ACCEL_CACHE_DIR=$SCRATCH/N/accel " if step.own_caches else cache
    other = "".join(f"{k}={v} " for k, v in (step.env() or {}).items() if k != "PYTHONPATH")
    return other + cache + shlex.join(["python", *cmd[1:]]).replace(scratch, "$SCRATCH")


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for every step together")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gpu.md")
    parser.add_argument("--only", help="comma-separated step names: run these alone, in the plan's order")
    args = parser.parse_args()
    steps = STEPS
    if args.only:
        unknown = set(args.only.split(",")) - {step.name for step in STEPS}
        if unknown:
            parser.error(f"--only: no step {', '.join(sorted(unknown))}; the steps: "
                         f"{', '.join(step.name for step in STEPS)}")
        steps = [step for step in STEPS if step.name in args.only.split(",")]
    import torch

    gpu = torch.cuda.is_available()
    if args.dry_run or not gpu:
        print(f"dry run ({'a' if gpu else 'no'} CUDA GPU here): nothing runs" if args.dry_run else NO_GPU)
        print(f"The checks it would run ({args.budget:.0f} s in all, each step at most its own budget):")
        for number, step in enumerate(steps, 1):
            commands = step.commands("/scratch")
            what = f"budget {step.budget_s} s{', its processes at once' * step.parallel}" if commands else "a note"
            print(f"{number}. {step.name}: {step.title} ({what})")
            details = [f"$ {show(cmd, step, '/scratch')}" for cmd in commands] or [f"note: {step.note()}"]
            print("".join(f"   {line}\n" for line in details) if args.dry_run else "", end="")
        return 0
    began, doc = time.monotonic(), []
    for number, step in enumerate(steps, 1):
        doc += ["", f"## {number}. {step.title}"]
        left = began + args.budget - time.monotonic()
        if not step.commands("/scratch"):
            doc.append(check(False, f"{step.title}: {step.note()}", "SKIPPED"))
        elif left < min(20, step.budget_s):
            doc.append(check(False, f"{step.title}: the {args.budget:.0f} s budget was spent ({left:.0f} s left)",
                             "SKIPPED"))
        else:
            print(f"[gpu] {number}. {step.title} (at most {min(step.budget_s, left):.0f} s)", flush=True)
            start = time.monotonic()
            runs = run_step(step, start + min(step.budget_s, left))
            shown = list(dict.fromkeys(run["shown"] for run in runs))
            doc += [f"{len(runs)} process(es), {time.monotonic() - start:.0f} s (budget {step.budget_s} s): "
                    + ", ".join(f"`{command}`" for command in shown) + ("" if len(shown) == len(runs) else ", twice"),
                    "", *step.report(runs)]
    head = [f"# GPU checks: `make bench-gpu` (bench/gpu.py), {time.strftime('%Y-%m-%d')}", "",
            f"Every check only a GPU can show, each step in processes of its own, within one {args.budget:.0f} s "
            f"budget (this run: {time.monotonic() - began:.0f} s). One run: every time is a single measurement.",
            "", "## Setup", *gpu_machine_lines(), "", "## Checks", *(f"- {state}: {what}" for state, what in checks)]
    args.out.write_text("\n".join(head + doc) + "\n")
    print("\n".join(f"{state}: {what}" for state, what in checks) + f"\nwrote {args.out}")
    return 1 if any(state == "FAIL" for state, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
