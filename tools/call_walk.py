"""The walk of one warm compiled model call through the pack's engine, counted (issue #71: "a warm compiled block
call crosses at most 6 files, none entered twice, counted by a command in the docs"; accel/compile/README.md).

    .venv/bin/python -m tools.call_walk [--path dynamo|precompiled] [--model accel-sd15-small.safetensors] [--json]

Loads the generated SD1.5 UNet with ComfyUI's own loader, applies Compile Model with `choose=always compiled` (so
every block call is compiled from the first), samples twice to warm it, then runs one more sampling step under
`sys.setprofile` and reads, from the pack's own frames only (files under accel/). It runs on a compile cache of
its own, empty at the start, so the path is the one asked for: `dynamo` (the default), the kinds' graphs compiled
in this process and called through Dynamo; `precompiled`, the same graphs saved whole by the background child
(ACCEL_SAVE_COMPILES) and loaded, as a restart or a fleet worker serves them, called without Dynamo:
- per model call: the files the call enters outside its block calls, and how often each is entered (a call from
  another file into it is one entry);
- per block call (from the dispatcher's `__call__` to its return): the files it crosses and their entries, the
  median over the call's blocks (every block call of a warm compiled call takes the same walk, which this checks).
Files are named relative to accel/. The numbers depend on the code only, not on the machine or its load.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

DISPATCH_ENTRY = ("compile/dispatch.py", "__call__")


def walk_of(run, accel_dir: str) -> list[tuple[str, str, str]]:
    """The pack's call and return events while `run()` runs: (event, file relative to accel/, function) for each
    frame whose code lives under `accel_dir`, and whether its caller's file was another one ("enter") or the same."""
    events = []

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        name = frame.f_code.co_filename
        if not name.startswith(accel_dir):
            return
        rel = name[len(accel_dir):].lstrip("/")
        if event == "call":
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            events.append(("enter" if caller != name else "call", rel, frame.f_code.co_name))
        else:
            events.append(("return", rel, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return events


def split_walk(events: list) -> tuple[collections.Counter, list[collections.Counter]]:
    """(entries per file outside block calls, [entries per file inside each block call]). A block call is the
    span from the dispatcher's __call__ to its return; entering the dispatcher counts as its first entry."""
    outside: collections.Counter = collections.Counter()
    blocks: list[collections.Counter] = []
    depth = 0  # the dispatcher's own nesting: a block inside a block (none in a UNet) stays in the outer one
    for event, rel, func in events:
        at_dispatch = (rel, func) == DISPATCH_ENTRY
        if event in ("enter", "call") and at_dispatch:
            if depth == 0:
                blocks.append(collections.Counter())
            depth += 1
        target = blocks[-1] if depth else outside
        if event == "enter":
            target[rel] += 1
        if event == "return" and at_dispatch:
            depth -= 1
    return outside, blocks


def measure(model_name: str, path: str = "dynamo") -> dict:
    import os
    import tempfile

    # a compile cache of its own, so no kind finds another run's precompiled functions: the path is the one asked
    os.environ["ACCEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="accel-call-walk-")
    os.environ["ACCEL_SAVE_COMPILES"] = "1" if path == "precompiled" else "0"
    import torch

    from tools.comfy_env import import_comfyui, load_pack

    import_comfyui(cpu=True)
    import comfy.sample
    import nodes

    pack = load_pack()
    engine = pack.accel.compile
    accel_dir = str(Path(engine.__file__).parent.parent)  # as the frames name it: through custom_nodes/, unresolved
    model = nodes.UNETLoader().load_unet(model_name, "default")[0]
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(0))
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]

    def sample(steps: int):
        latent = torch.zeros(1, 4, 16, 16)
        noise = comfy.sample.prepare_noise(latent, 0)
        return comfy.sample.sample(compiled, noise, steps, 5.0, "euler", "normal", positive, negative, latent,
                                   disable_pbar=True, seed=0)

    sample(2)
    sample(2)  # warm: every kind compiled, the second sampling compiles nothing
    if path == "precompiled":  # the child saves them whole once this process is idle; the next call loads them
        background = engine.background.BACKGROUND
        while background.stats()["held_until_idle"]:
            time.sleep(0.1)
        background.wait(timeout=600)
        sample(1)
        served = {e.kind.label: e.precompiled.calls for r in engine.model_record.records_of(compiled.model)
                  for e in r.entries}
        if not served or not all(served.values()):
            raise SystemExit(f"the saved graphs did not serve every kind: {served}")
        sample(1)
    events = walk_of(lambda: sample(1), accel_dir)
    outside, blocks = split_walk(events)
    if not blocks:
        raise SystemExit("no block call went through the pack's dispatcher: Compile Model found no blocks?")
    walks = collections.Counter(tuple(sorted(b.items())) for b in blocks)
    typical = dict(walks.most_common(1)[0][0])
    return {
        "model": model_name, "path": path,
        "block_calls": len(blocks),
        "block_walks": len(walks),  # how many different walks the block calls took
        "block_files": len(typical),
        "block_entries": typical,
        "block_files_entered_twice": sorted(f for f, n in typical.items() if n > 1),
        "block_files_median": statistics.median(len(b) for b in blocks),
        "model_call_files": len(outside),
        "model_call_entries": dict(sorted(outside.items())),
        "all_files": len(set(outside) | {f for b in blocks for f in b}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="accel-sd15-small.safetensors")
    parser.add_argument("--path", choices=("dynamo", "precompiled"), default="dynamo",
                        help="the warm call's compiled path: Dynamo's graphs, or the precompiled functions")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    result = measure(args.model, args.path)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}, {result['path']} path: one warm model call (1 step, cond and uncond batched), "
          f"{result['block_calls']} block calls in {result['block_walks']} walk(s)")
    print(f"a block call crosses {result['block_files']} files; entered more than once: "
          f"{result['block_files_entered_twice'] or 'none'}")
    for name, n in result["block_entries"].items():
        print(f"    {n}x {name}")
    print(f"the model call outside its blocks enters {result['model_call_files']} files:")
    for name, n in result["model_call_entries"].items():
        print(f"    {n}x {name}")
    print(f"{result['all_files']} engine files in all")


if __name__ == "__main__":
    main()
