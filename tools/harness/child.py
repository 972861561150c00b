"""Run benchmark variants each in a fresh process with empty compile caches of its own.

A fresh process gives honest peak RSS, and empty caches mean "cold" is cold for every variant: torch's inductor
cache (TORCHINDUCTOR_CACHE_DIR, used by eager and the core node) and the pack's persistent cache (ACCEL_CACHE_DIR)
both point into a temporary directory. `shared_cache` gives every variant the same directory instead, for
measuring a second process on the first one's cache. The script is re-run as `script --child VARIANT ...` and
must print one line `RESULT <json>`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path


def run_result_process(command: list[str], env: dict, label: str) -> dict:
    """Run a benchmark child process and return the JSON of its one `RESULT <json>` line; stop the benchmark
    with the child's error output when it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    line = [out for out in proc.stdout.splitlines() if out.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-4000:]}")
    return json.loads(line[0][len("RESULT "):])


def run_variants(script: str, variants: list[str], child_args: list[str], shared_cache: bool = False) -> list[dict]:
    results = []
    shared_dir = tempfile.TemporaryDirectory(prefix="accel-bench-shared-") if shared_cache else nullcontext()
    with shared_dir as shared:
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="accel-bench-cache-") as own:
                cache = Path(shared or own)
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "torch"),
                       "ACCEL_CACHE_DIR": str(cache / "accel")}
                results.append(run_result_process([sys.executable, script, "--child", variant, *child_args],
                                                  env, variant))
            print(json.dumps(results[-1]), flush=True)
    return results


def write_report(name: str, report: dict) -> dict:
    """Add the machine and versions to `report`, write it to bench/results/<name>.json, print its ratios."""
    import platform

    import torch

    from tools.comfy_env import ROOT, comfyui_version

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    report = {"benchmark": name, **report,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {gpu}", "torch": torch.__version__,
              "comfyui": comfyui_version(), "python": platform.python_version()}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report.get("ratios", {}), indent=2))
    return report
