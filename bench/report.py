"""Every scenario side by side in one run, one report: `make bench` (full-size models) and `make bench-quick`
(the small models). Each scenario (bench/scenarios.py) runs on each model in a fresh process with empty caches,
then a second fresh process on the same caches (a warm restart); REPORT.md puts each against eager ComfyUI of the
same run. --update keeps the other models' tables of the report in --out; --first-prompt times only each
scenario's first prompt, in --rounds fresh processes each (bench/README.md).

    .venv/bin/python bench/report.py [--quick] [--out DIR] [--scenarios a,sd15:b] [--families sd15,flux] [--update]
"""
from __future__ import annotations

import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from report_output import first_prompt_markdown, write_report
from scenarios import BY_NAME, FIRST_PROMPT, SCENARIOS, models
from tools.comfy_env import ROOT
from tools.harness import cli
from tools.harness.child import cache_env, run_result_process
from tools.harness.variants import rel_error

CHILD = Path(__file__).resolve().parent / "report_child.py"


def run_child(scenario: str, family: str, phase: str, cache: Path, outputs: Path, quick: bool) -> dict:
    command = [sys.executable, str(CHILD), scenario, family, phase, str(outputs), *(["--quick"] if quick else [])]
    start = time.perf_counter()
    result = run_result_process(command, cache_env(cache), f"{family}/{scenario} ({phase})")
    result["process_s"] = time.perf_counter() - start
    return result


def quality(outputs: Path, family: str, scenario: str) -> dict:
    """The steady output against eager's: the largest latent error relative to eager's largest value, and the
    decoded image's PSNR (dB)."""
    import math

    import torch

    mine = torch.load(outputs / f"{family}-{scenario}-cold.pt")
    eager = torch.load(outputs / f"{family}-eager-cold.pt")
    out = {"max_rel_error": rel_error(mine["samples"], eager["samples"])}
    if mine["image"] is not None and eager["image"] is not None:
        mse = torch.mean((mine["image"].float() - eager["image"].float()) ** 2).item()
        out["psnr_db"] = None if mse == 0 else 10 * math.log10(1.0 / mse)  # None: the same image
        out["image_equal"] = mse == 0
    return out


def main() -> None:
    parser = cli.parser(__doc__, rounds=5)
    parser.add_argument("--quick", action="store_true", help="the small models (make bench-quick)")
    parser.add_argument("--out", help="where REPORT.md and its charts go (default: docs/benchmarks, or "
                                      "bench/results/quick with --quick; --first-prompt: bench/results)")
    parser.add_argument("--scenarios", help="names from bench/scenarios.py (default: all; --first-prompt: "
                                            f"{','.join(FIRST_PROMPT)}); FAMILY:NAME runs one on that family only")
    parser.add_argument("--families", default="sd15,flux")
    parser.add_argument("--update", action="store_true",
                        help="keep the other models' tables of the report in --out (same machine and versions)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="no unmeasured eager process before a model's runs (for runs whose times nobody reads, "
                             "as CI's test of the report's form); the report says so")
    parser.add_argument("--first-prompt", action="store_true",
                        help="only each scenario's first prompt after a cold start, in --rounds fresh processes each")
    args = parser.parse_args()
    pool = list(BY_NAME.values()) if args.first_prompt else SCENARIOS
    results = ROOT / "bench" / "results"
    out = Path(args.out or (results if args.first_prompt else results / "quick" if args.quick else
                            ROOT / "docs" / "benchmarks"))
    wanted: dict[str, set[str]] = {"eager": set()}
    default = FIRST_PROMPT if args.first_prompt else [s.name for s in SCENARIOS]
    for item in (args.scenarios or ",".join(default)).split(","):
        family, _, name = item.rpartition(":")
        wanted.setdefault(name, set()).add(family or "*")
    unknown = sorted(set(wanted) - {s.name for s in pool})
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; pick from {', '.join(s.name for s in pool)}")
    bench_models = {f: m for f, m in models(args.quick).items() if f in args.families.split(",")}
    skipped, plan = [], {}
    for family in bench_models:
        asked = [s for s in pool if wanted.get(s.name, set()) & {"*", family}]
        skipped += [{"family": family, "scenario": s.name, "why": s.why_not}
                    for s in asked if family not in s.families]
        runnable = [s for s in asked if family in s.families]
        if runnable:  # every ratio is against eager of the same run: eager runs first wherever another does
            plan[family] = [BY_NAME["eager"]] + [s for s in runnable if s.name != "eager"]
    missing = missing_model_files({f: bench_models[f] for f in plan}, swapping=wanted_swap(plan))
    if missing:  # found before an hour of runs, not at the scenario that needs the file
        parser.error(f"model files missing from ComfyUI's diffusion_models folder: {', '.join(missing)}; write "
                     f"them with `{'make bench-quick' if args.quick else 'make models'}` (tools/make_models.py)")
    if args.first_prompt:
        return first_prompts(plan, bench_models, args.rounds, args.quick, out)
    kept = kept_families(out, set(bench_models), args.quick) if args.update else None
    runs, measured = [], {}
    with tempfile.TemporaryDirectory(prefix="accel-report-") as tmp:
        outputs = Path(tmp) / "outputs"
        outputs.mkdir()
        for family, runnable in plan.items():  # a model none of whose scenarios runs is neither read nor warmed
            start = time.perf_counter()
            if not args.no_warm_up:
                warm_up(bench_models[family], Path(tmp), args.quick, swapping=family in wanted_swap(plan))
            for scenario in runnable:
                cache = Path(tmp) / f"cache-{family}-{scenario.name}"
                cold = run_child(scenario.name, family, "cold", cache, outputs, args.quick)
                warm = run_child(scenario.name, family, "warm", cache, outputs, args.quick)
                cold["warm_restart"] = {k: warm[k] for k in ("first_prompt_s", "startup_s", "compiles_first_prompt",
                                                             "peak_rss_mib")}
                cold["quality"] = quality(outputs, family, scenario.name)
                runs.append(cold)
                print(f"{family:>5} {scenario.name:<18} first prompt {cold['first_prompt_s']:7.2f} s, warm "
                      f"restart {warm['first_prompt_s']:7.2f} s, steady {cold['steady_s_per_step']:.3f} s/step",
                      flush=True)
            measured[family] = {"date": datetime.date.today().isoformat(), "wall_s": time.perf_counter() - start,
                                "warmed_up": not args.no_warm_up}
    total_s = sum(m["wall_s"] for m in measured.values())
    for record in measured.values():  # one run of these models: its whole length
        record.update(wall_s=total_s, models=sorted(measured))
    if kept:
        order = list(models(args.quick))  # the report's tables in the usual order, kept or new
        runs = sorted(kept["runs"] + runs, key=lambda r: order.index(r["family"]))
        skipped = sorted(kept["skipped"] + skipped, key=lambda s: order.index(s["family"]))
        measured = {**kept["measured"], **measured}
        bench_models = {f: m for f, m in models(args.quick).items() if f in measured}
    report = write_report(out, runs, skipped, bench_models, quick=args.quick, measured=measured)
    print(f"wrote {report}")


def first_prompts(plan: dict, bench_models: dict, rounds: int, quick: bool, out: Path) -> None:
    """--first-prompt: each scenario's first prompt in `rounds` fresh processes with empty caches of their own (the
    child's "warm" phase on an empty cache), the scenarios interleaved round by round so that the machine's drift
    falls on all of them alike; out/first_prompt[_quick].md (medians against eager's) and .json."""
    started, times = time.time(), {}
    with tempfile.TemporaryDirectory(prefix="accel-first-prompt-") as tmp:
        for family, scenarios in plan.items():
            warm_up(bench_models[family], Path(tmp), quick, swapping=False)  # no Swap Weights: its file unread
            times[family] = {s.name: [] for s in scenarios}
            for round_no in range(rounds):
                for scenario in scenarios:
                    run_dir = Path(tmp) / f"{family}-{scenario.name}-{round_no}"
                    (run_dir / "outputs").mkdir(parents=True)
                    result = run_child(scenario.name, family, "warm", run_dir / "cache", run_dir / "outputs", quick)
                    times[family][scenario.name].append(result["first_prompt_s"])
                    print(json.dumps({"family": family, "scenario": scenario.name, "round": round_no + 1,
                                      "first_prompt_s": round(result["first_prompt_s"], 2)}), flush=True)
    text = first_prompt_markdown(times, bench_models, rounds, started, quick)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"first_prompt{'_quick' if quick else ''}.md").write_text(text + "\n")
    (out / f"first_prompt{'_quick' if quick else ''}.json").write_text(json.dumps(times, indent=1))
    print(text)


def model_folder() -> Path:
    from tools.comfy_env import comfyui_dir

    return comfyui_dir() / "models" / "diffusion_models"


def wanted_swap(plan: dict) -> set[str]:
    """The families whose runs include Swap Weights, the only scenario that reads the second file."""
    return {family for family, scenarios in plan.items() if any(s.name == "swap" for s in scenarios)}


def model_files(bench, swapping: bool) -> tuple[str, ...]:
    return (bench.file, bench.swap_file) if swapping else (bench.file,)


def missing_model_files(bench_models: dict, swapping: set[str]) -> list[str]:
    """The files of `bench_models` (family: BenchModel) not in ComfyUI's folder; the second file only for the
    families in `swapping` (`make setup` writes the small models' first files, not the second Flux one)."""
    folder = model_folder()
    return [name for family, bench in bench_models.items() for name in model_files(bench, family in swapping)
            if not (folder / name).exists()]


def warm_up(bench, tmp: Path, quick: bool, swapping: bool = True) -> None:
    """Before a model's measured runs: its files are read into the OS page cache, then one unmeasured eager
    prompt runs in a process of its own, so that the first measured process (eager's, the denominator of every
    ratio) starts as the later ones do, with the model file and the libraries in the page cache. Without it,
    eager's first prompt of the benchmark Flux read the file from disk: 15.6 s against 8.6 s (2026-11-24)."""
    folder = model_folder()
    for name in model_files(bench, swapping):
        with open(folder / name, "rb") as handle:
            while handle.read(64 << 20):
                pass
    outputs = tmp / "warm-up"
    outputs.mkdir(exist_ok=True)
    run_child("eager", bench.family, "warm", tmp / f"cache-{bench.family}-warm-up", outputs, quick)


def kept_families(out: Path, rerun: set[str], quick: bool) -> dict:
    """The runs of the report in `out` for the models not run again (--update), with when they were measured.
    Refuses a report of another machine or versions, or of the other model sizes (quick or full): its tables
    would not compare with the new ones."""
    from report_output import family_measured
    from tools.harness.machine import versions

    path = out / "report.json"
    if not path.exists():
        sys.exit(f"--update: no report.json in {out} to keep tables from; run without --update")
    data = json.loads(path.read_text())
    differs = {k: (data.get(k), v) for k, v in {**versions(), "quick": quick}.items() if data.get(k) != v}
    if differs:
        sys.exit(f"--update: the report in {out} was measured elsewhere ({differs}); run every model without "
                 "--update")
    families = {r["family"] for r in data["runs"]} - rerun
    return {"runs": [r for r in data["runs"] if r["family"] in families],
            "skipped": [s for s in data["skipped"] if s["family"] in families],
            "measured": {f: family_measured(data, f) for f in families}}


if __name__ == "__main__":
    main()
