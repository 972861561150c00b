"""Run in a fresh process by test_compile_model.py, with an empty ACCEL_CACHE_DIR: Compile VAE's defaults
(choose="auto", background compile) on TAESD, as a user's first workflow in a new install meets them.

As ComfyUI's executor runs nodes, the VAE is loaded and decodes in inference mode (its parameters are inference
tensors that require grad). Decodes a latent eagerly, then with the compiled VAE: the first decode (its kind is sent to the background child
and runs eagerly), the decode after the child is done (loads its graphs from the persistent cache), one more.
Auto mode's margins are set so the compiled path is kept whatever this machine measures: what is tested is where
the compile happens. Prints one JSON line: Dynamo frames and torch's on-disk cache counters around each decode,
and each output's largest difference from eager.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests"))

from tools.comfy_env import load_pack  # noqa: E402
from tools.harness.child import print_result  # noqa: E402


def main() -> None:
    engine = load_pack(as_in_a_server=True).accel.compile
    import torch

    engine.kind_choice.FASTER_MARGIN = engine.auto_mode.WHOLE_CALL_MARGIN = 100.0
    with torch.inference_mode():  # as in ComfyUI's executor
        result = decode_and_report(engine)
    print_result(result)


def decode_and_report(engine) -> dict:
    import nodes
    import torch
    from compile_helpers import dynamo_frames, wait_for_idle_release

    (vae,) = nodes.VAELoader().load_vae("taesd")
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    eager = vae.decode(latent)
    compiled = engine.compile_vae(vae, engine.CompileOptions())
    decodes = []

    def decode(label: str) -> None:
        before = {"frames": dynamo_frames(), **engine.dynamo_runner.disk_cache_counters()}
        out = compiled.decode(latent)
        after = {"frames": dynamo_frames(), **engine.dynamo_runner.disk_cache_counters()}
        decodes.append({"label": label, **{k: after[k] - before[k] for k in after},
                        "max_abs_diff": (out - eager).abs().max().item(), "eager_max_abs": eager.abs().max().item()})

    decode("first")
    at_return = engine.background.BACKGROUND.stats()
    idle_release_s = wait_for_idle_release(engine)  # as a server between prompts: nothing asks for the child
    before = {"frames": dynamo_frames(), **engine.dynamo_runner.disk_cache_counters()}
    waited = engine.background.BACKGROUND.wait(timeout=900)
    after = {"frames": dynamo_frames(), **engine.dynamo_runner.disk_cache_counters()}
    wait_counters = {k: after[k] - before[k] for k in after}  # on the CPU the child's graphs load in the wait
    for label in ("after the child", "warm", "warm again"):
        decode(label)
    stats = engine.REGISTRY.stats()
    return {"decodes": decodes, "waited": waited, "wait_counters": wait_counters, "at_return": at_return,
            "idle_release_s": idle_release_s, "jobs": engine.background.BACKGROUND.stats()["finished"],
            "kinds": [{"kind": k["kind"], "background": k["background"], "path": k["path"],
                       "precompiled": k["precompiled"]} for k in stats["kinds"]]}


if __name__ == "__main__":
    main()
