"""Inductor's check of the CPU's vector instruction sets, run for real once per test run instead of in each of
the run's processes.

Before its first C++ kernel, every process that compiles or loads inductor's CPU code checks which instruction
sets (AVX2, AVX-512, ...) the C++ compiler builds for: it builds a test library per set and loads it in a new
Python process that imports torch (torch/_inductor/cpu_vec_isa.py). That is about 10 s of CPU in each of the
suite's processes (the two test processes, every ComfyUI server, probe and background child): about a tenth of
the suite's CPU time on the 2-core test machine, whose cores the suite keeps busy (2026-11-26 and 27).

Here the run's first process runs that check once, in a fresh process, and compares it with what the CPU's flags
list (the pack's own comparison for its own compiles, accel/compile/cpu_isa.py's `probe`). Where every flagged set
builds and loads, the run's processes get inductor's own switch TORCHINDUCTOR_VEC_ISA_OK=1 (inherited, as
OMP_NUM_THREADS is): inductor then trusts the flags, which that one check showed to be true, so the kernels are
the same. Its checks of AVX-512 BF16 and VNNI, which torch runs whatever the switch, still run in every process,
so the pack's CPU-checks thread (accel/compile/background/cpu_checks.py) still waits on real subprocesses where
the CPU has them (on the test CPU 3 checks of the 6 remain: 5.0 s instead of 10.4 s in a process alone,
2026-11-27). Where any set fails, or ACCEL_TEST_ISA_CHECKS=each, every process checks for itself as a user's
does. The verdict is kept with the compiler cache's kept builds (one folder per compiler, torch and CPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SWITCH = "TORCHINDUCTOR_VEC_ISA_OK"
VERDICT_FILE = "vec-isa-verdict.json"
ROOT = Path(__file__).resolve().parent.parent
# the pack's own comparison (torch's check against the CPU's flags), in a fresh process: torch caches its check
PROBE = "import json; from accel.compile.cpu_isa import probe; print(json.dumps(probe()))"


def decide(kept_folder: Callable[[], Path | None]) -> str:
    """Set the switch for this run's processes where the one real check allows it; what was decided, in words.
    The run's later processes (the test processes) find the decision in their environment; only the first asks
    `kept_folder` where a verdict may be kept."""
    if SWITCH in os.environ:
        return f"{SWITCH}={os.environ[SWITCH]} as given"
    if os.environ.get("ACCEL_TEST_ISA_CHECKS") == "each":
        return "each process checks the CPU's vector instruction sets (ACCEL_TEST_ISA_CHECKS=each)"
    verdict = _verdict(kept_folder())
    if not verdict.get("all_build"):
        os.environ["ACCEL_TEST_ISA_CHECKS"] = "each"  # the test processes inherit the decision, not the check
        return f"each process checks the CPU's vector instruction sets (one check found {verdict})"
    os.environ[SWITCH] = "1"
    return f"{SWITCH}=1: the CPU's flagged vector instruction sets {verdict['built']} all built once"


def _verdict(kept_folder: Path | None) -> dict:
    path = kept_folder / VERDICT_FILE if kept_folder else None
    if path is not None:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # none kept yet (or unreadable): check
    env = {name: value for name, value in os.environ.items() if name != SWITCH}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    try:
        verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"all_build": False, "error": (proc.stderr or proc.stdout)[-300:]}
    if path is not None:
        try:
            path.write_text(json.dumps(verdict))
        except OSError:
            pass  # checked again by the next run
    return verdict
