"""Run in a fresh process by test_compile_model.py, with an empty ACCEL_CACHE_DIR: Compile Model's defaults
(choose="auto", background compile) on a generated model (LTX-Video by default: one block kind, so each child
compiles one kind and the test stays short), as a user's first workflow in a new install meets them.

    python tests/background_probe.py [--steps 4] [--family ltxv]

Samples the model eagerly, then compiled: the first sampling while the child process compiles, then the same
model compiled with other options (other compile keys, queued for a second child), then (after waiting for both
children) the sampling that loads the graphs from the persistent cache, one more, and the other options' model.
Then a new shape (a longer prompt, a wider latent): the sampling while a third child compiles its graph, the one
that loads it, and one more; then a third shape along the same dimensions, which that graph serves. Auto mode's margins are set so compiled paths are kept whatever this machine
measures: what is tested is where compiles happen, not which path is faster here. After each sampling the
probe sleeps until work held for an idle moment has started, as a server waits between prompts (idle_gate.py).
Prints one JSON line: Dynamo frames and torch's on-disk cache counters around each sampling and each wait for
the children, the outputs' largest difference from eager, and
the registry's stats.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

from tools.comfy_env import load_pack  # noqa: E402
from tools.harness.child import print_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--family", default="ltxv")
    args = parser.parse_args()

    engine = load_pack(as_in_a_server=True).accel.compile
    import nodes
    from compile_helpers import dynamo_frames, wait_for_idle_release
    from tools.families import BY_FAMILY, load, sample

    family = BY_FAMILY[args.family]
    engine.kind_choice.FASTER_MARGIN = engine.auto_mode.WHOLE_CALL_MARGIN = 100.0

    def counters() -> dict:
        return {"frames": dynamo_frames(), **engine.dynamo_runner.disk_cache_counters()}

    def delta(before: dict, after: dict) -> dict:
        return {k: after[k] - before[k] for k in after}

    model = load(nodes, family)
    eager = sample(model, family, steps=args.steps)
    compiled = engine.compile_model(model, engine.CompileOptions())
    # Other options make other compile keys: its kinds are captured while the first child still runs, so they
    # go to a second child, started when the first ends.
    other = engine.compile_model(model, engine.CompileOptions(dynamic="static"))
    result = {"samplings": []}

    def run(label: str, which, reference=eager, **inputs) -> None:
        before = counters()
        during = []  # the background compiler's state at each step's end, while the sampling runs
        out = sample(which, family, steps=args.steps, callback=lambda *a: during.append(
            engine.background.BACKGROUND.stats()), **inputs)
        result.setdefault("background_during", {})[label] = during[-1]
        result.setdefault("background_at_return", {})[label] = engine.background.BACKGROUND.stats()
        result.setdefault("idle_release_s", {})[label] = wait_for_idle_release(engine)
        result.setdefault("background_after", {})[label] = engine.background.BACKGROUND.stats()
        result["samplings"].append({"label": label, **delta(before, counters()),
                                    "max_abs_diff": (out - reference).abs().max().item(),
                                    "eager_max_abs": reference.abs().max().item()})

    run("while compiling", compiled)
    run("other options, queued", other)
    result["queued"] = engine.background.BACKGROUND.stats()["queued"]
    start, before = time.perf_counter(), counters()
    result["waited"] = engine.background.BACKGROUND.wait(timeout=900)
    result["wait_seconds"] = round(time.perf_counter() - start, 1)
    result["wait_counters"] = delta(before, counters())  # on the CPU the child's graphs load in the wait
    run("after the child", compiled)
    run("warm", compiled)
    run("other options, after its child", other)
    result["stats"] = engine.REGISTRY.stats()

    shape = family.latent_shape
    new_shape = {"tokens": 2 * family.tokens, "latent_shape": (*shape[:-1], 2 * shape[-1])}
    eager_new = sample(model, family, steps=args.steps, **new_shape)
    run("new shape, while its child compiles", compiled, eager_new, **new_shape)
    before = counters()
    result["new_shape_waited"] = engine.background.BACKGROUND.wait(timeout=900)
    result["new_shape_wait_counters"] = delta(before, counters())
    run("new shape, after its child", compiled, eager_new, **new_shape)
    run("new shape, warm", compiled, eager_new, **new_shape)
    result["new_shape_stats"] = engine.REGISTRY.stats()
    # A third shape along the same dimensions: the new shape's graph made them dynamic, so it serves this one too
    third_shape = {"tokens": 3 * family.tokens, "latent_shape": (*shape[:-1], 3 * shape[-1])}
    run("third shape", compiled, sample(model, family, steps=args.steps, **third_shape), **third_shape)
    result["third_shape_stats"] = engine.REGISTRY.stats()

    # Another node swaps ComfyUI's attention function (skip-guidance nodes do for one model call, attention patch
    # nodes for good): no graph saved with ComfyUI's own serves a call meanwhile, and they serve again after.
    import comfy.ldm.modules.attention as attention

    picked = attention.optimized_attention

    def scaled_attention(*call_args, **call_kwargs):
        return 1.5 * picked(*call_args, **call_kwargs)

    attention.optimized_attention = scaled_attention
    try:
        eager_swapped = sample(model, family, steps=args.steps)
        result["swap_changes_eager"] = (eager_swapped - eager).abs().max().item()
        run("attention swapped", compiled, eager_swapped)
    finally:
        attention.optimized_attention = picked
    run("attention restored", compiled)
    result["restored_stats"] = engine.REGISTRY.stats()
    print_result(result, default=str)


if __name__ == "__main__":
    main()
