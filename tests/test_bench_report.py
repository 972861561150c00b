"""`make bench-quick`'s harness (bench/report.py) writes a well-formed report: REPORT.md with a table per model and
a row per scenario run, report.json with every run's ratios against eager of the same run, and PNG charts that
are real images. Never a speed: CI machines differ; the report says what was measured.

CI runs a subset of the scenarios (the whole quick run takes longer than CI's budget allows beside the suite):
DeepCache on the small SD1.5 UNet, which runs beside eager (every ratio is against eager of the same run), and
Compile VAE on the tiny Flux, which has no VAE here: it is left out, which the report must say (and no eager runs
on Flux, with nothing to compare: the Flux files are neither needed nor read, so `make setup`'s models suffice,
without the second tiny Flux that `make bench-quick` writes). It runs without the unmeasured eager process that
makes first prompts comparable (`--no-warm-up`: nothing here reads a time), which the report must say. The
compiling scenarios (minutes each here, with their background children) are left to `make bench-quick`; their
rows are in docs/benchmarks/quick/, and the suite tests Compile Model's paths directly.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.comfy_env import ROOT

SCENARIOS = ("sd15:deepcache", "flux:compile_vae")
pytestmark = pytest.mark.full(why=(
    "bench/report.py end to end (a benchmark run); make test runs the GPU command's CPU rehearsal in "
    "test_bench_gpu.py"))


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, comfy_dir):
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--quick", "--out", str(out),
                           "--scenarios", ",".join(SCENARIOS), "--families", "sd15,flux", "--no-warm-up"],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_report_has_a_row_per_scenario_and_ratios_against_eager(report_dir):
    sys.path.append(str(ROOT / "bench"))
    from scenarios import BY_NAME

    data = json.loads((report_dir / "report.json").read_text())
    runs = {(r["family"], r["scenario"]) for r in data["runs"]}
    assert runs == {("sd15", "eager"), ("sd15", "deepcache")}
    assert data["skipped"] == [{"family": "flux", "scenario": "compile_vae", "why": BY_NAME["compile_vae"].why_not}]
    for run in data["runs"]:
        for key in ("first_prompt_s", "steady_prompt_s", "peak_rss_mib"):
            assert run[key] > 0, (run["family"], run["scenario"], key)
        assert run["warm_restart"]["first_prompt_s"] > 0
        if run["scenario"] == "eager":
            assert run["quality"]["max_rel_error"] == 0.0
        if run["scenario"] == "deepcache":  # against this run's eager; a real cache, so not the same picture
            eager = next(r for r in data["runs"] if r["family"] == run["family"] and r["scenario"] == "eager")
            assert run["ratios"]["steady_speedup"] == pytest.approx(
                eager["steady_prompt_s"] / run["steady_prompt_s"], rel=1e-3), run["ratios"]
            # and against the same workflow without DeepCache, prompt for prompt in its own process
            assert run["ratios"]["steady_speedup_same_process"] == pytest.approx(
                run["steady_eager_here_prompt_s"] / run["steady_prompt_s"], rel=1e-3), run["ratios"]
            assert 0 < run["quality"]["max_rel_error"] < 1.0, run["quality"]
            assert run["background"] is None and run["compiles_total"] == 0, run
    report = (report_dir / "REPORT.md").read_text()
    assert "small (accel-sd15-small)" in report and "tiny (accel-tiny-flux)" not in report  # no Flux run
    rows = [line for line in report.splitlines() if line.startswith("| ") and "---" not in line
            and not line.startswith("| scenario")]
    assert len(rows) == len(data["runs"])
    assert all(line.count("|") == 16 for line in rows), rows
    assert "compile_vae on flux" in report and data["torch"] in report
    assert "Measured without the harness's unmeasured eager warm-up process" in report  # --no-warm-up, said


def test_report_charts_are_images(report_dir):
    import matplotlib.image

    for name in ("report_headline.png", "report_quality_speed.png"):
        path = report_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400, (name, pixels.shape)
        assert pixels[..., :3].std() > 0.05, f"{name} is blank"
        assert f"({name})" in (report_dir / "REPORT.md").read_text()
