"""Run in a fresh process by test_auto_mode_fair.py, with an empty ACCEL_CACHE_DIR: Compile Model's defaults on the
small SD1.5 UNet through ComfyUI's sampler, as a user meets them after the first prompt of a new install.

Why a process of its own: compiled kinds are shared by every model of a process (registry.py), so in the suite's
process the kinds of this UNet may already have graphs for every size and batch another test sampled, and then no
change below would meet inputs its graphs do not serve (what the test is about).

Samples the first configuration until its kinds are compiled, loaded and timed; then, two rounds of: another
size, cfg 1 (a batch of 1: Dynamo specialises size 1), a batch of 2 and the first configuration again, each
compared with eager, then a wait for the children. The second round shows that one round of children served every
change (at most one more compile per kind). Auto mode's margins are set so the compiled paths are kept
whatever this machine measures: what is tested is where compiles happen. Prints one JSON line: the verdict, each
sampling's Dynamo frames and difference from eager, and each round's blocks run eagerly for a new input shape.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

from tools.comfy_env import load_pack  # noqa: E402
from tools.harness.child import print_result  # noqa: E402

FIRST = dict(size=16, batch=1, cfg=5.0)
CHANGES = [dict(size=24, batch=1, cfg=5.0), dict(size=24, batch=1, cfg=1.0), dict(size=24, batch=2, cfg=5.0), FIRST]


def main() -> None:
    engine = load_pack(as_in_a_server=True).accel.compile
    engine.kind_choice.FASTER_MARGIN = engine.auto_mode.WHOLE_CALL_MARGIN = 1e9
    print_result(sample_changes(engine), default=str)


def sample_changes(engine) -> dict:
    import nodes
    from compile_helpers import assert_close_to_eager, dynamo_frames, load, sample

    model = load(nodes)
    compiled = engine.compile_model(model, engine.CompileOptions())
    background = engine.background.BACKGROUND
    sample(compiled, **FIRST)
    (record,) = engine.model_record.records_of(compiled.model)
    waits = [background.wait(timeout=600)]
    for _ in range(6):  # loaded, then timed per kind and checked
        sample(compiled, **FIRST)
        if record.auto.verdict is not None:
            break

    def new_shape_eager_calls() -> int:
        entries = {e.key: e for e in record.entries}.values()
        return sum(e.eager_calls[engine.dispatch.NEW_SHAPE_IN_BACKGROUND] for e in entries)

    eager_outputs = {}  # each change's eager output, sampled once (the second round repeats the first's changes)

    def unlike_eager(out, change: dict) -> str | None:
        key = tuple(sorted(change.items()))
        if key not in eager_outputs:
            eager_outputs[key] = sample(model, **change)
        try:
            assert_close_to_eager(out, eager_outputs[key], str(change))
        except AssertionError as error:
            return str(error)
        return None

    rounds = []
    for _ in range(2):  # the children after the first round take what it could not run compiled
        eager_before, samplings = new_shape_eager_calls(), []
        for change in CHANGES:
            frames, start = dynamo_frames(), time.perf_counter()
            out = sample(compiled, **change)
            samplings.append({**change, "frames": dynamo_frames() - frames, "seconds": time.perf_counter() - start,
                              "unlike_eager": unlike_eager(out, change)})
        rounds.append({"samplings": samplings, "new_shape_eager_calls": new_shape_eager_calls() - eager_before})
        waits.append(background.wait(timeout=600))
    return {"verdict": record.auto.verdict, "status": record.auto.status(record.entries), "waits": waits,
            "rounds": rounds}


if __name__ == "__main__":
    main()
