"""The benchmark report's files: REPORT.md (tables per model, machine, versions, settings), report.json (every
number) and PNG charts made with matplotlib (latency and speedup per scenario, quality against speed)."""
from __future__ import annotations

import datetime
import json
import statistics
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.harness.machine import versions
from tools.harness.results import markdown_table, pyplot, save_chart

HEADLINE_CHART = "report_headline.png"  # first prompt and steady speed against eager: the README shows it
QUALITY_CHART = "report_quality_speed.png"
FIRST_PROMPT_BOUND = 1.2  # issue #13: the first prompt with the pack takes at most 1.2x eager's
REPORT_COLUMNS = ["scenario", "first prompt s", "x eager", "warm restart s", "x eager", "steady prompt s", "s/step",
                  "speed x eager, same process", "x eager's process", "compiles (first prompt / all)",
                  "recompiles, steady", "peak RSS MiB", "x eager", "largest error", "PSNR dB"]


def with_ratios(runs: list[dict]) -> list[dict]:
    """Each run's ratios against eager of the same family in this run."""
    eager = {r["family"]: r for r in runs if r["scenario"] == "eager"}
    for r in runs:
        e = eager[r["family"]]
        r["ratios"] = {"first_prompt_vs_eager": r["first_prompt_s"] / e["first_prompt_s"],
                       "warm_restart_vs_eager": r["warm_restart"]["first_prompt_s"] /
                       e["warm_restart"]["first_prompt_s"],
                       "steady_speedup": e["steady_prompt_s"] / r["steady_prompt_s"],
                       # eager in this process, prompt for prompt (report_child.py); eager's own run is 1.0
                       "steady_speedup_same_process": r.get("steady_eager_here_prompt_s", r["steady_prompt_s"]) /
                       r["steady_prompt_s"],
                       "peak_rss_vs_eager": r["peak_rss_mib"] / e["peak_rss_mib"]}
    return runs


def _family_runs(runs: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["family"], []).append(r)
    return by


def _labels(runs: list[dict]) -> list[str]:
    from scenarios import BY_NAME

    return [BY_NAME[r["scenario"]].label for r in runs]


def _bar_pairs(ax, first: list[float], second: list[float], labels: list[str], names, colors) -> None:
    """A pair of bars per label (`first` above, its value written), a line at 1x."""
    y = range(len(first))
    ax.barh([i - 0.2 for i in y], first, height=0.4, label=names[0], color=colors[0])
    ax.barh([i + 0.2 for i in y], second, height=0.4, label=names[1], color=colors[1])
    ax.axvline(1.0, color="black", linewidth=0.8)
    for i, value in enumerate(first):
        ax.text(value, i - 0.2, f" {value:.2f}x", va="center", fontsize=7)
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()


def headline_chart(path: Path, runs: list[dict], titles: dict[str, str]) -> None:
    plt = pyplot()
    by = _family_runs(runs)
    fig, axes = plt.subplots(len(by), 2, figsize=(12, 1.2 + 0.45 * max(len(v) for v in by.values()) * len(by)),
                             squeeze=False)
    for row, (family, fruns) in enumerate(by.items()):
        ax = axes[row][0]
        cold = [r["ratios"]["first_prompt_vs_eager"] for r in fruns]
        warm = [r["ratios"]["warm_restart_vs_eager"] for r in fruns]
        _bar_pairs(ax, cold, warm, _labels(fruns), ("cold start", "warm restart"), ("#d1495b", "#edae49"))
        ax.axvline(FIRST_PROMPT_BOUND, color="grey", linestyle="--", linewidth=0.8, label="1.2x bound")
        ax.set_xscale("log")  # a compile in the prompt's path is tens of times eager's; caches are fractions
        ax.set_xlim(0.1, max(10.0, 2 * max(cold + warm)))
        ax.set_xlabel("first prompt latency, x eager (log scale; lower is better)")
        ax.set_title(titles[family], fontsize=9, loc="left")
        ax.legend(fontsize=7, loc="lower right")
        ax = axes[row][1]
        _bar_pairs(ax, [r["ratios"]["steady_speedup_same_process"] for r in fruns],
                   [r["ratios"]["steady_speedup"] for r in fruns], [""] * len(fruns),
                   ("vs eager in the same process", "vs eager's own process"), ("#00798c", "#8cc5cf"))
        ax.set_xlabel("steady prompt speed, x eager (higher is better)")
        ax.legend(fontsize=7, loc="best")  # where no bar is: the fastest scenarios' bars reach the right edge
    save_chart(fig, path)


def quality_chart(path: Path, runs: list[dict], titles: dict[str, str]) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 5.2))
    floor = 1e-8  # equal outputs (error 0) are drawn on the floor of the log scale
    for family, fruns in _family_runs(runs).items():
        xs = [r["ratios"]["steady_speedup_same_process"] for r in fruns]
        ys = [max(r["quality"]["max_rel_error"], floor) for r in fruns]
        ax.scatter(xs, ys, label=titles[family], marker="o" if family == "sd15" else "s")
        for x, y, label in zip(xs, ys, _labels(fruns)):
            ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("steady prompt speed, x eager in the same process")
    ax.set_ylabel("largest latent error vs eager (relative)")
    ax.set_title("quality against speed (each scenario against eager of the same run)", fontsize=9)
    # below the plot: points fill the corners (caches top right, exact scenarios bottom left, compiles between)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    save_chart(fig, path)


def _steady_paths(paths: dict) -> str:
    """How the compiled model ran in the steady state: its kinds' paths, and auto mode's whole-call verdict."""
    chosen, kept = paths["compiled"], paths["eager"]
    kinds = (f"auto mode chose {len(chosen)} of {len(chosen) + len(kept)} kinds compiled"
             + (f", kept {', '.join(kept)} eager" if kept else ""))
    verdicts = paths.get("verdicts")
    if verdicts is None:  # runs before 2026-11-24 recorded the kinds' paths only
        return f"{kinds} (this run did not record the whole-call verdict, which may run the model eagerly)"
    if not verdicts:  # no whole-call check (Compile VAE alone)
        return f"in the steady state {kinds}"
    if verdicts == ["eager"]:
        blocks = [k for k in chosen if ".decode[" not in k and ".encode[" not in k]  # Compile VAE's kinds apart
        why = ("its whole calls were not clearly faster with the compiled blocks" if blocks
               else "no block kind was faster compiled")
        return f"in the steady state the diffusion model ran eagerly ({why}): {kinds}"
    return f"in the steady state {kinds}; whole-call verdict: {', '.join(verdicts)}"


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _psnr(quality: dict) -> str:
    return "equal" if quality.get("image_equal") else _fmt(quality.get("psnr_db"), 1)


def family_measured(data: dict, family: str) -> dict:
    """When a report.json's table of `family` was measured: its date, the run's length and the models in that run
    (a report written before per-model records: the whole report's)."""
    if family in data.get("measured", {}):
        return data["measured"][family]
    return {"date": data["date"], "wall_s": data["wall_s"], "models": sorted({r["family"] for r in data["runs"]})}


def _run_words(measured: dict) -> str:
    models = "this model only" if len(measured["models"]) == 1 else "these models: " + ", ".join(measured["models"])
    return f"on {measured['date']}, in a run of {measured['wall_s'] / 60:.1f} minutes ({models})"


def markdown(runs: list[dict], skipped: list[dict], bench_models: dict, info: dict, quick: bool,
             measured: dict) -> str:
    command = "make bench-quick" if quick else "make bench"
    one_run = len({(m["date"], m["wall_s"]) for m in measured.values()}) == 1
    when = (f"on {next(iter(measured.values()))['date']}, in "
            f"{next(iter(measured.values()))['wall_s'] / 60:.1f} minutes" if one_run else
            f"on {info['date']} from more than one run (`--update`): each model's table is one run, named under "
            "its heading")
    lines = [
        "# ComfyUI-Accel benchmark report", "",
        f"Written by `{command}` (bench/report.py) {when}. "
        f"Machine: {info['machine']}; Python {info['python']}, torch {info['torch']}, ComfyUI {info['comfyui']}.",
        "",
        "Every scenario ran in a fresh process with empty caches of its own (torch's inductor cache and the pack's "
        "persistent cache), as a newly started ComfyUI server would: the first prompt (load the model file, apply "
        "the scenario's nodes, sample, decode), the background compile if any, then the steady state; a second "
        "fresh process on the same caches timed the first prompt of a warm restart. **All ratios are against eager "
        "ComfyUI of the same model in the same run, one run**: absolute times drift between runs on a shared "
        "machine.", "",
        f"![first prompt and steady speed]({HEADLINE_CHART})", "",
        f"![quality against speed]({QUALITY_CHART})", "",
    ]
    for family, fruns in _family_runs(runs).items():
        bench = bench_models[family]
        lines += [f"## {bench.label}", ""]
        if not one_run:
            lines += [f"Measured {_run_words(measured[family])}.", ""]
        if not measured[family].get("warmed_up"):
            lines += ["Measured without the harness's unmeasured eager warm-up process (bench/report.py `warm_up`, "
                      "since 2026-11-24): eager's first prompt, the first process of the model's runs, may include "
                      "reading the model file or torch's libraries from disk, which flatters the other scenarios' "
                      "first-prompt ratios.", ""]
        lines += [f"`{bench.file}`, latent {bench.latent}x{bench.latent}, {bench.steps} steps, cfg {bench.cfg}, "
                  f"euler/normal, batch 1{', TAESD decode' if family == 'sd15' else ', no decode'}.", "",
                  *markdown_table(REPORT_COLUMNS, [[
                      label, _fmt(r["first_prompt_s"]), _fmt(r["ratios"]["first_prompt_vs_eager"]),
                      _fmt(r["warm_restart"]["first_prompt_s"]), _fmt(r["ratios"]["warm_restart_vs_eager"]),
                      _fmt(r["steady_prompt_s"], 3), _fmt(r["steady_s_per_step"], 3),
                      _fmt(r["ratios"]["steady_speedup_same_process"]), _fmt(r["ratios"]["steady_speedup"]),
                      f"{r['compiles_first_prompt']} / {r['compiles_total']}", r["recompiles_steady"],
                      f"{r['peak_rss_mib']:.0f}", _fmt(r["ratios"]["peak_rss_vs_eager"]),
                      f"{r['quality']['max_rel_error']:.1e}", _psnr(r["quality"])]
                      for r, label in zip(fruns, _labels(fruns))]), ""]
        for r in fruns:
            if r.get("background"):
                b = r["background"]
                lines.append(f"- {r['scenario']}: the background child compiled {b['kinds']} kinds in {b['jobs']} "
                             f"jobs; waiting for it after the first prompt took {b['wait_s']:.1f} s; child peak RSS "
                             f"{b['child_peak_rss_mib']:.0f} MiB.")
            if r.get("kind_paths"):
                lines.append(f"- {r['scenario']}: {_steady_paths(r['kind_paths'])}. The prompt that loaded the "
                             f"compiled kinds took {_fmt(r.get('second_prompt_s'))} s.")
            if "swap_prompt_s" in r:
                lines.append(f"- Swap Weights to `{bench.swap_file}`: the prompt after the swap took "
                             f"{r['swap_prompt_s']:.2f} s (steady prompt {r['steady_prompt_s']:.2f} s), "
                             f"{r['swap_recompiles']} compiles; largest error against that file run eagerly "
                             f"{r['swap_max_rel_error_vs_eager']:.1e}." + (
                                 "" if r.get("swap_in_workflow") else
                                 " (Runs before 2026-11-24 called the node without its workflow: it could not "
                                 "find the model's own file, so it wrote the model's weights to a spill file "
                                 "first, the slower path of docs/benchmarks/swap_weights.md.)"))
        lines.append("")
    if skipped:
        lines += ["## Not run", ""] + [f"- {s['scenario']} on {s['family']}: {s['why']}." for s in skipped] + [""]
    lines += [
        "## What the columns mean", "",
        "- *first prompt*: from the prompt's start (loaders) to its decoded output, in a process whose imports are "
        "done (a server's start); the model file and torch's libraries come from the OS page cache (before a "
        "model's runs the harness reads its files and runs one unmeasured eager prompt, so that eager's run, the "
        "first, does not alone read them from disk; tables measured without it say so). *warm restart*: the "
        "same in a new process on the first one's caches.",
        "- *steady prompt*: median of the prompts after the one that loads the background child's graphs; "
        "*s/step* its sampling time per step; *speed x eager, same process*: the same workflow without the "
        "scenario's nodes, run right after each steady prompt in the same process, over the scenario's (medians); "
        "*x eager's process*: eager's own run's steady prompt over the scenario's (machine-wide drift between "
        "processes moves this one: eager's own steady sampling of the small SD1.5 UNet, 6 steps, varied 0.86 to "
        "1.39 s between processes on the 2-core test CPU, torch 2.11.0+cu130, ComfyUI 0.3.75, 2026-11-23).",
        "- *compiles*: Dynamo frames compiled in the process (the background child's are not counted there); "
        "*recompiles, steady*: frames compiled during the steady prompts (0 expected).",
        "- *largest error*: the steady output latent's largest difference from eager's, relative to eager's "
        "largest value; *PSNR*: of the decoded image against eager's (`equal`: identical). Caches (DeepCache, "
        "EasyCache) trade error for speed by design; compiled blocks differ from eager by rounding only.",
        "- *peak RSS*: the process's high-water mark (the background child's peak is listed apart).", ""]
    return "\n".join(lines)


def first_prompt_markdown(results: dict, bench_models: dict, rounds: int, started: float, quick: bool) -> str:
    """`report.py --first-prompt`'s document: per model, each scenario's median first prompt, every round, and
    the median's ratio to eager's median against the bound."""
    from scenarios import BY_NAME

    info, minutes = versions(), (time.time() - started) / 60
    lines = ["# The first prompt after a cold start, with the pack and without it", "",
             f"`bench/report.py --first-prompt{' --quick' if quick else ''} --rounds {rounds}`, one run, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {minutes:.0f} min. Machine: "
             f"{info['machine']}; Python {info['python']}, torch {info['torch']}, ComfyUI {info['comfyui']}.", "",
             "Each number is one fresh process with empty caches (torch's and the pack's): the prompt's loaders, "
             "the scenario's nodes at their defaults, sampling and decoding, as the report's first prompt. The "
             f"scenarios run interleaved, {rounds} rounds, after one unmeasured eager process per model (its files "
             f"in the page cache). Bound: the median at most {FIRST_PROMPT_BOUND}x eager's median.", ""]
    for family, times in results.items():
        bench, eager = bench_models[family], statistics.median(times["eager"])
        rows = [[BY_NAME[name].label, f"{statistics.median(values):.2f}", ", ".join(f"{v:.2f}" for v in values),
                 f"{statistics.median(values) / eager:.2f}x", "-" if name == "eager" else
                 ("yes" if statistics.median(values) / eager <= FIRST_PROMPT_BOUND else "no")]
                for name, values in times.items()]
        lines += [f"## {bench.label}, {bench.latent}x{bench.latent} latent, {bench.steps} steps, cfg {bench.cfg}", "",
                  *markdown_table(["scenario", "first prompt, median (s)", "each round (s)", "median / eager's",
                                   "within 1.2x"], rows), ""]
    return "\n".join(lines)


def write_report(out: Path, runs: list[dict], skipped: list[dict], bench_models: dict, quick: bool,
                 measured: dict, info: dict | None = None) -> Path:
    """`measured`: for each model, when its runs were measured ({"date", "wall_s", "models"}: the date, the
    length of that run and the models it ran)."""
    out.mkdir(parents=True, exist_ok=True)
    info = info or {**versions(), "date": datetime.date.today().isoformat()}
    runs = with_ratios(runs)
    titles = {family: bench_models[family].label for family in bench_models}
    headline_chart(out / HEADLINE_CHART, runs, titles)
    quality_chart(out / QUALITY_CHART, runs, titles)
    (out / "report.json").write_text(json.dumps({**info, "quick": quick, "measured": measured, "runs": runs,
                                                 "skipped": skipped}, indent=2, default=str))
    report = out / "REPORT.md"
    report.write_text(markdown(runs, skipped, bench_models, info, quick, measured))
    return report


def rerender(out: Path) -> Path:
    """REPORT.md and the charts again from `out`/report.json, the same measurements (after a change to how the
    report shows them)."""
    from scenarios import models

    data = json.loads((out / "report.json").read_text())
    info = {k: data[k] for k in ("machine", "python", "torch", "comfyui", "date")}
    bench_models = {f: m for f, m in models(data["quick"]).items() if any(r["family"] == f for r in data["runs"])}
    measured = {f: family_measured(data, f) for f in bench_models}
    return write_report(out, data["runs"], data["skipped"], bench_models, data["quick"], measured, info)


if __name__ == "__main__":  # python bench/report_output.py DIR: re-render DIR's report from its report.json
    import sys

    print(f"wrote {rerender(Path(sys.argv[1]))}")
