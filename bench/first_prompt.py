"""The first prompt after a cold start, with the pack's nodes and without them, over several rounds (#13).

The report (bench/report.py) times each scenario's first prompt once, and on this 2-core machine one process's
first prompt differs from the next one's by up to a quarter: one run cannot say whether a ratio of 1.28 is the
pack's or the machine's. Here each scenario's first prompt runs in `--rounds` fresh processes, each with empty
caches of its own (torch's and the pack's, as in the report), the scenarios interleaved round by round so that
the machine's drift falls on all of them alike. Reported per model: each scenario's median first prompt, its
spread, and the median's ratio to eager's median, against the issue's bound (1.2x eager).

The process is the report's own child (bench/report_child.py) in its first-prompt-only phase ("warm", here on an
empty cache): loaders, the scenario's nodes, sampling, decoding; the process ends after the prompt (a background
compile child ends with it).

    .venv/bin/python bench/first_prompt.py [--quick] [--families sd15,flux] [--rounds 5] [--out FILE]
        [--scenarios eager,compile,compile_vae,compile_and_vae]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from report import missing_model_files, run_child, warm_up
from scenarios import BY_NAME, models
from tools.harness import cli
from tools.harness.machine import versions
from tools.harness.results import results_path

BOUND = 1.2  # the issue's: the first prompt with the pack at most 1.2x the same workflow without it


def measure(family: str, scenarios: list[str], rounds: int, quick: bool, tmp: Path) -> dict[str, list[float]]:
    warm_up(models(quick)[family], tmp, quick, swapping=False)  # no Swap Weights here: its second file unread
    times: dict[str, list[float]] = {name: [] for name in scenarios}
    for round_no in range(rounds):
        for name in scenarios:
            run_dir = tmp / f"{family}-{name}-{round_no}"
            outputs = run_dir / "outputs"
            outputs.mkdir(parents=True)
            result = run_child(name, family, "warm", run_dir / "cache", outputs, quick)  # an empty cache: cold
            times[name].append(result["first_prompt_s"])
            print(json.dumps({"family": family, "scenario": name, "round": round_no + 1,
                              "first_prompt_s": round(result["first_prompt_s"], 2)}), flush=True)
    return times


def markdown(results: dict, bench_models: dict, rounds: int, started: float, minutes: float, quick: bool) -> str:
    info = versions()
    lines = ["# The first prompt after a cold start, with the pack and without it", "",
             f"`bench/first_prompt.py{' --quick' if quick else ''} --rounds {rounds}`, one run, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {minutes:.0f} min. Machine: "
             f"{info['machine']}; Python {info['python']}, torch {info['torch']}, ComfyUI {info['comfyui']}.", "",
             "Each number is one fresh process with empty caches (torch's and the pack's): the prompt's loaders, "
             "the scenario's nodes at their defaults, sampling and decoding, as the report's first prompt. The "
             f"scenarios run interleaved, {rounds} rounds, after one unmeasured eager process per model (its files "
             f"in the page cache). Bound: the median at most {BOUND}x eager's median.", ""]
    for family, times in results.items():
        bench = bench_models[family]
        eager = statistics.median(times["eager"])
        lines += [f"## {bench.label}, {bench.latent}x{bench.latent} latent, {bench.steps} steps, cfg {bench.cfg}", "",
                  "| scenario | first prompt, median (s) | each round (s) | median / eager's | within 1.2x |",
                  "| --- | --- | --- | --- | --- |"]
        for name, values in times.items():
            median = statistics.median(values)
            ratio = median / eager
            lines.append(f"| {BY_NAME[name].label} | {median:.2f} | {', '.join(f'{v:.2f}' for v in values)} | "
                         f"{ratio:.2f}x | {'-' if name == 'eager' else ('yes' if ratio <= BOUND else 'no')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = cli.parser(__doc__, rounds=5)
    parser.add_argument("--quick", action="store_true", help="the small models")
    parser.add_argument("--families", default="sd15,flux")
    parser.add_argument("--scenarios", default="eager,compile,compile_vae,compile_and_vae")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    bench_models = {f: m for f, m in models(args.quick).items() if f in args.families.split(",")}
    missing = missing_model_files(bench_models, swapping=set())
    if missing:
        sys.exit(f"missing model files: {', '.join(missing)}; write them with "
                 f"`{'make bench-quick' if args.quick else 'make models'}` (tools/make_models.py)")
    wanted = args.scenarios.split(",")
    if "eager" not in wanted:
        wanted.insert(0, "eager")  # every ratio is against eager's median
    unknown = [name for name in wanted if name not in BY_NAME]
    if unknown:
        sys.exit(f"unknown scenarios {unknown}: choose among {', '.join(BY_NAME)}")
    started = time.time()
    results = {}
    with tempfile.TemporaryDirectory(prefix="accel-first-prompt-") as tmp:
        for family in bench_models:
            names = [name for name in wanted if family in BY_NAME[name].families]
            results[family] = measure(family, names, args.rounds, args.quick, Path(tmp))
    text = markdown(results, bench_models, args.rounds, started, (time.time() - started) / 60, args.quick)
    out = args.out or results_path(f"first_prompt{'_quick' if args.quick else ''}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    (out.with_suffix(".json")).write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
