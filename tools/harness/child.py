"""The child-process protocol of the benchmarks and of the tests' probes: a script run in a fresh process prints
one line `RESULT <json>`; the parent runs it and reads that line.

A benchmark re-runs itself as `script --child VARIANT ...` (cli.parser's hidden option), one fresh process per
variant. A fresh process gives honest peak RSS, and empty caches mean "cold" is cold for every variant: torch's
inductor cache (TORCHINDUCTOR_CACHE_DIR, used by eager and the core node) and the pack's persistent cache
(ACCEL_CACHE_DIR) both point into a temporary directory (`cache_env`). `shared_cache` gives every variant the same
directory instead, for measuring a second process on the first one's cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

PREFIX = "RESULT "


def print_result(result: dict, **json_args) -> None:
    """The child's side: its one result line (`json_args` for json.dumps, e.g. default=str)."""
    print(PREFIX + json.dumps(result, **json_args), flush=True)


def read_result(stdout: str) -> dict | None:
    """The parent's side: the JSON of the first `RESULT <json>` line of a child's output, None without one."""
    lines = [line for line in stdout.splitlines() if line.startswith(PREFIX)]
    return json.loads(lines[0][len(PREFIX):]) if lines else None


def cache_env(cache: Path, env: dict | None = None) -> dict:
    """`env` (default: this process's) with torch's inductor cache and the pack's cache in `cache`."""
    return {**(os.environ if env is None else env), "TORCHINDUCTOR_CACHE_DIR": str(cache / "torch"),
            "ACCEL_CACHE_DIR": str(cache / "accel")}


def run_result_process(command: list[str], env: dict, label: str) -> dict:
    """Run a benchmark child process and return its result; stop the benchmark with the child's error output when
    it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    result = read_result(proc.stdout)
    if proc.returncode or result is None:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-4000:]}")
    return result


def run_variants(script: str, variants: list[str], child_args: list[str] | None = None,
                 shared_cache: bool = False) -> list[dict]:
    """Each variant's result from `script --child VARIANT *child_args` (default: this process's own arguments),
    in turn, each on empty caches of its own (or, with `shared_cache`, all on one)."""
    child_args = sys.argv[1:] if child_args is None else child_args
    results = []
    shared_dir = tempfile.TemporaryDirectory(prefix="accel-bench-shared-") if shared_cache else nullcontext()
    with shared_dir as shared:
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="accel-bench-cache-") as own:
                command = [sys.executable, script, "--child", variant, *child_args]
                results.append(run_result_process(command, cache_env(Path(shared or own)), variant))
            print(json.dumps(results[-1]), flush=True)
    return results
