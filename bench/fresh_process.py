"""Run benchmark variants each in a fresh process with an empty inductor cache of its own.

A fresh process gives honest peak RSS, and an empty cache means "cold" is cold for every variant. The script
is re-run as `script --child VARIANT ...` and must print one line `RESULT <json>`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_variants(script: str, variants: list[str], child_args: list[str]) -> list[dict]:
    results = []
    for variant in variants:
        with tempfile.TemporaryDirectory(prefix="accel-bench-inductor-") as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            proc = subprocess.run([sys.executable, script, "--child", variant, *child_args],
                                  capture_output=True, text=True, env=env)
        line = [out for out in proc.stdout.splitlines() if out.startswith("RESULT ")]
        if proc.returncode or not line:
            raise SystemExit(f"{variant} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(line[0][len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    return results
