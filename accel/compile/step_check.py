"""choose="auto", third stage: keep a model's compiled blocks only if whole UNet calls are faster with them.

The earlier stages leave kinds too small to matter uncompiled (patcher's profile call) and time each other kind
alone on its first call, keeping the faster path per kind (registry.KindEntry._choose_path). That is not enough:
kinds can win alone and still make the whole call slower (measured on a CPU, docs/benchmarks/compile_model.md:
the kinds that won alone made whole steps 7% slower; why was not measured). So once the kinds of a model have
their paths, the model's next UNet calls alternate between the chosen paths and plain eager. These are the
sampler's real calls, so the check costs no extra work. When one kind of call (same input shape, same number of
block calls, so DeepCache's shallow calls are never compared with full ones) has been timed enough on both
sides, the model keeps its compiled blocks only if they were faster by a margin; otherwise it runs eagerly from
then on, with no per-block dispatch at all. The verdict holds for the model, its clones and its options on that
device.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

log = logging.getLogger("comfyui_accel")

SAMPLES_PER_PATH = 2
# Keep the compiled blocks only when faster by this margin: within timing noise, eager is the safe choice.
FASTER_MARGIN = 0.98
# Calls that never line up (every call a new shape): stop checking and keep what the per-kind timing chose.
MAX_CALLS = 24


@dataclass
class StepCheck:
    """The whole-call comparison of one model (diffusion model, options, device)."""

    model_label: str
    profiled: bool = False  # its first call ran eagerly to time each kind's share (registry.MIN_CALL_SHARE)
    samples: dict[tuple, dict[str, list[float]]] = field(default_factory=dict)
    calls: int = 0
    verdict: str | None = None  # None while checking, then "compiled" or "eager"
    reason: str = ""

    def next_path(self) -> str:
        # Pairs (compiled, compiled, eager, eager, ...), so that calls which alternate in kind (DeepCache's full
        # and shallow steps, cond and uncond run as separate calls) still see both paths.
        return "compiled" if (self.calls // 2) % 2 == 0 else "eager"

    def record(self, call_key: tuple, path: str, seconds: float) -> None:
        self.calls += 1
        by_path = self.samples.setdefault(call_key, {"compiled": [], "eager": []})
        by_path[path].append(seconds)
        if all(len(times) >= SAMPLES_PER_PATH for times in by_path.values()):
            self._decide(by_path)
        elif self.calls >= MAX_CALLS:
            self.verdict = "compiled"
            self.reason = (f"no {SAMPLES_PER_PATH} comparable calls on each path in {MAX_CALLS} calls; "
                           "keeping the per-kind choice")
            log.info("[Accel] Compile Model (%s): %s", self.model_label, self.reason)

    def _decide(self, by_path: dict[str, list[float]]) -> None:
        compiled_s, eager_s = statistics.median(by_path["compiled"]), statistics.median(by_path["eager"])
        faster = compiled_s < eager_s * FASTER_MARGIN
        self.verdict = "compiled" if faster else "eager"
        self.reason = (f"whole UNet calls took {compiled_s:.3f} s with the compiled blocks vs {eager_s:.3f} s "
                       f"eager (median of {len(by_path['compiled'])} and {len(by_path['eager'])})")
        log.info("[Accel] Compile Model (%s): %s: %s", self.model_label, self.reason,
                 "keeping the compiled blocks" if faster else
                 "running this model eagerly (compiled blocks were not faster here; choose='always compiled' "
                 "keeps them anyway)")

    def stats(self) -> dict:
        return {"verdict": self.verdict or "checking", "reason": self.reason, "calls_timed": self.calls,
                "seconds": {str(list(key)): times for key, times in self.samples.items()}}
