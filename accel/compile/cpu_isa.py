"""On the CPU, skip inductor's per-process probe of the vector instruction sets once this environment passed it.

Before its first C++ kernel in a process, inductor checks which vector instruction sets (AVX2, AVX-512, ...) the
C++ compiler can build for, by compiling a test library and loading it in a new Python process per set: about
12 s on a 2-core CPU, in every process, even when every kernel then comes from the cache. Inductor's option
`cpp.vec_isa_ok=True` skips that check and trusts the CPU's flags. The pack passes it to its own compiles only
(torch.compile options, never a global setting), and only when this environment's real probe once found that
every set the CPU's flags list does build; the verdict is kept in the environment's cache directory. The option
is part of inductor's cache key, so a process uses it from its first compile on, or not at all.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..cache.store import write_atomic

log = logging.getLogger("comfyui_accel")
VERDICT_FILE = "cpu_vec_isa.json"


def vec_isa_options(env_dir: Path) -> dict:
    """{"cpp.vec_isa_ok": True} when this environment's probe verdict allows it, else {}."""
    path = env_dir / VERDICT_FILE
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        verdict = _probe(path)
    return {"cpp.vec_isa_ok": True} if verdict.get("all_build") else {}


def probe() -> dict:
    """torch's own check of the vector instruction sets against the list the CPU's flags give: "all_build" when
    every flagged set builds (also what the test suite decides its processes' checks by: tests/vec_isa_once.py)."""
    from torch._inductor import config, cpu_vec_isa

    try:
        built = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # torch's own probe, which it caches
        with config.patch({"cpp.vec_isa_ok": True}):
            flagged = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
        return {"all_build": bool(built) and built == flagged, "built": built, "flagged": flagged}
    except Exception as err:  # noqa: BLE001  (an unexpected torch: keep torch's own per-process check)
        return {"all_build": False, "error": f"{type(err).__name__}: {err}"[:300]}


def _probe(path: Path) -> dict:
    verdict = probe()
    try:
        write_atomic(path, json.dumps(verdict).encode())
    except OSError:
        pass  # not persisted: the next process probes again, as torch would
    log.info("[Accel] CPU vector instructions: %s", verdict)
    return verdict
