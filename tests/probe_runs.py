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
                meet: Path | None = None, saves: bool = False, family: str | None = FAMILY) -> subprocess.Popen:
    """A probe process sampling into `out` (and eagerly into `eager` first, if given), running on its own; with
    `meet`, it compiles only once another probe given the same folder is ready to; with `saves`, what it compiles
    is saved whole by a child after the call, as a user's ComfyUI does (ACCEL_SAVE_COMPILES, off in the suite
    elsewhere: conftest.py), and it waits for that child before it reports. `family` None: the small SD1.5 UNet
    (three kinds, one of them a SpatialTransformer, whose forward writes into its transformer_options)."""
    env = {**os.environ, "ACCEL_CACHE_DIR": str(cache)}
    if saves:
        env["ACCEL_SAVE_COMPILES"] = "1"
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the pack chooses torch's cache folder inside its own
    args = [sys.executable, str(PROBE), *(["--family", family] if family else []), "--save-output", str(out)]
    args += ["--save-eager", str(eager)] if eager else []
    args += ["--meet", str(meet)] if meet else []
    args += ["--wait-background"] if saves else []
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result_of(probe: subprocess.Popen) -> tuple[dict, str]:
    """The probe's report (its RESULT line) and its stderr, once it ended well."""
    stdout, stderr = probe.communicate(timeout=900)
    result = read_result(stdout)
    assert probe.returncode == 0 and result is not None, stderr[-4000:]
    return result, stderr


def run_probe(cache: Path, out: Path, eager: Path | None = None, saves: bool = False,
              family: str | None = FAMILY) -> tuple[dict, str]:
    return result_of(start_probe(cache, out, eager, saves=saves, family=family))
