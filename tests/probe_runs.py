"""Run tests/cache_probe.py in a fresh process on a given compile cache directory, as test_compile_cache.py and
test_cache_faults.py do: LTX-Video (one block kind: a short compile) through Compile Model, "always compiled"."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tools.harness.child import read_result

PROBE = Path(__file__).with_name("cache_probe.py")
FAMILY = "ltxv"


def start_probe(cache: Path, out: Path, eager: Path | None = None,
                meet: Path | None = None) -> subprocess.Popen:
    """A probe process sampling into `out` (and eagerly into `eager` first, if given), running on its own; with
    `meet`, it compiles only once another probe given the same folder is ready to."""
    env = {**os.environ, "ACCEL_CACHE_DIR": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the pack chooses torch's cache folder inside its own
    args = [sys.executable, str(PROBE), "--family", FAMILY, "--save-output", str(out)]
    args += ["--save-eager", str(eager)] if eager else []
    args += ["--meet", str(meet)] if meet else []
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result_of(probe: subprocess.Popen) -> tuple[dict, str]:
    """The probe's report (its RESULT line) and its stderr, once it ended well."""
    stdout, stderr = probe.communicate(timeout=900)
    result = read_result(stdout)
    assert probe.returncode == 0 and result is not None, stderr[-4000:]
    return result, stderr


def run_probe(cache: Path, out: Path, eager: Path | None = None) -> tuple[dict, str]:
    return result_of(start_probe(cache, out, eager))
