"""Run in a fresh process by test_compile_cache.py and test_cache_faults.py: sample a model through Compile Model
(choose="always compiled") and report what the compile cache did. The cache directory comes from ACCEL_CACHE_DIR,
as it would for a user.

    python tests/cache_probe.py [--size 16] [--batch 1] [--save-output FILE] [--family NAME] [--save-eager FILE]

--family samples a generated family (tools/families.py) at its own small latent instead of the small SD1.5 UNet;
--save-eager first samples the model without Compile Model and saves that latent.

Prints one JSON line: Dynamo frames, torch's on-disk cache hit/miss counters, compile seconds, cache stats, and
what changed in torch's Dynamo/inductor config, version and TORCHINDUCTOR_CACHE_DIR from before the pack was
loaded to after it compiled and sampled (nothing may: the pack's settings live inside its own compile calls).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

from tools.comfy_env import import_comfyui, load_pack  # noqa: E402
from tools.harness.child import print_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--save-output", help="torch.save the sampled latent here")
    parser.add_argument("--family", help="a generated model family (tools/families.py) instead of the SD1.5 UNet")
    parser.add_argument("--save-eager", help="torch.save the latent sampled without Compile Model here")
    parser.add_argument("--meet", help="a folder where two probes wait for each other before they compile")
    parser.add_argument("--wait-background", action="store_true",
                        help="after sampling, wait for the background child (the save of what compiled here)")
    args = parser.parse_args()

    import_comfyui(cpu=True)
    import nodes
    import torch
    from compile_helpers import dynamo_frames, load, sample
    from hygiene_probe import config_snapshot, diff

    def torch_state() -> dict:
        return {**config_snapshot(), "env": {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}}

    # Inductor's once-per-process CPU checks first (new Python processes loading test libraries; on CPUs with
    # AVX-512 VNNI or BF16 they run even when the pack trusts the CPU's flags): a cold process runs them in the
    # pack's ISA probe before its timed compile, a process loading from the cache inside its timed load, so
    # compile_seconds compares the compile work alone only with the checks done before either (as the pack's
    # CPU-checks thread does in a server: accel/compile/background/cpu_checks.py).
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    valid_vec_isa_list()
    before = torch_state()
    engine = load_pack(as_in_a_server=True).accel.compile
    if args.family:
        from tools import families

        case = families.BY_FAMILY[args.family]
        model, run = families.load(nodes, case), lambda m: families.sample(m, case)
    else:
        model, run = load(nodes), lambda m: sample(m, size=args.size, batch=args.batch)
    if args.save_eager:
        torch.save(run(model), args.save_eager)
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    if args.meet:
        meet(Path(args.meet), 2)
    out = run(compiled)
    changed = diff(before, torch_state())
    if args.save_output:
        torch.save(out, args.save_output)
    background = None
    if args.wait_background:  # what a server does between prompts: the held job starts once idle, then ends
        from compile_helpers import wait_for_idle_release

        wait_for_idle_release(engine, timeout=120)
        engine.background.BACKGROUND.wait(timeout=600)
        background = engine.background.BACKGROUND.stats()
    stats = engine.REGISTRY.stats()
    print_result({"frames": dynamo_frames(), **stats["totals"], "compile_cache": stats["compile_cache"],
                  "paths": {k["kind"]: k["path"] for k in stats["kinds"]}, "torch_state_changes": changed,
                  "background": background,
                  "kinds": [{"kind": k["kind"], "background": k["background"], "precompiled": k["precompiled"]}
                            for k in stats["kinds"]]})


def meet(folder: Path, count: int, timeout: float = 300) -> None:
    """Wait until `count` processes got here (each leaves a file in `folder`), so that they compile at once: a
    process that started later, or sampled eagerly first, would otherwise find the other's graphs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.iterdir())) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(list(folder.iterdir()))} of {count} processes came to {folder}")
        time.sleep(0.01)


if __name__ == "__main__":
    main()
