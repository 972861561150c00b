"""Shared helpers for the compile tests: sampling and direct model calls through ComfyUI's real code paths."""
from __future__ import annotations

import torch

SMALL = "accel-sd15-small.safetensors"
SMALL_B = "accel-sd15-small-b.safetensors"


def load(comfy_nodes, name: str = SMALL):
    """A UNet file through ComfyUI's own UNETLoader node."""
    (model,) = comfy_nodes.UNETLoader().load_unet(name, "default")
    return model


def dynamo_frames() -> int:
    """Dynamo's own count of compiled frames (compiles and recompiles) in this process."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def dynamo_graph_breaks() -> int:
    """Dynamo's own count of graph breaks in this process (a compiled block split into several graphs)."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def conds(seed: int = 0):
    context = torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(seed))
    return [[context, {}]], [[torch.zeros_like(context), {}]]


def sample(model, size: int = 16, batch: int = 1, steps: int = 3, seed: int = 0, cfg: float = 5.0):
    """ComfyUI's own sampling entry point (what KSampler calls), euler, cond+uncond batched by ComfyUI."""
    import comfy.sample

    latent = torch.zeros(batch, 4, size, size)
    noise = comfy.sample.prepare_noise(latent, seed)
    positive, negative = conds(seed)
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", positive, negative, latent,
                               disable_pbar=True, seed=seed)


def apply_model(patcher, size: int = 16, batch: int = 2, seed: int = 0):
    """One call of BaseModel.apply_model with the patcher's wrappers, as ComfyUI's sampler makes it, on the
    model in whatever load state the test put it in (the sampler would reload it fully first)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, size, size, generator=generator)
    sigma = torch.full((batch,), 2.0)
    context = torch.randn(batch, 77, 768, generator=generator)
    options = dict(patcher.model_options["transformer_options"])
    options["wrappers"] = patcher.wrappers
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options)


def assert_close_to_eager(actual, expected, what: str) -> None:
    # Compiled float32 kernels reassociate sums: differences of ~1e-4 on values up to ~300 are expected.
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=2e-5 * max(scale, 1.0), msg=what)


def assert_every_artifact_whole(store, cache_dir) -> None:
    """Every artifact the pack saved under `cache_dir` unpacks (store.unpack_artifact checks its checksum): none
    torn or mixed by processes that wrote into one cache at once."""
    artifacts = sorted(cache_dir.rglob("artifacts/*/*.bin"))
    assert artifacts, f"nothing was saved in {cache_dir}"
    for path in artifacts:
        store.unpack_artifact(path.read_bytes())  # raises on a torn or mixed write


def cache_hits_by_kind(engine) -> dict[str, int]:
    """Each kind of this process (by label) and its calls served by an existing compiled graph so far: read before
    and after a call, it tells whether the call ran a graph an earlier test had compiled (kinds are shared)."""
    return {k["kind"]: k["cache_hits"] for k in engine.REGISTRY.stats()["kinds"]}


def own_kinds(engine, patcher, choose: str | None = None) -> list[dict]:
    """Registry stats of the kinds `patcher`'s model runs (each once; only its records with `choose`, if given),
    whatever else this process compiled: kinds are shared between models, so the registry holds other tests'."""
    entries = {e.key: e for record in engine.model_record.records_of(patcher.model)
               if choose is None or record.options.choose == choose for e in record.entries}
    return [e.stats() for e in entries.values()]


def wait_for_idle_release(engine, timeout: float = 60.0) -> float | None:
    """Sleep (this process idle) until background work held for an idle moment has started; the seconds that
    took, or None if it never did. What the idle gate does in a server between prompts (idle_gate.py)."""
    import time

    start = time.monotonic()
    while engine.background.BACKGROUND.stats()["held_until_idle"]:
        if time.monotonic() - start > timeout:
            return None
        time.sleep(0.1)
    return time.monotonic() - start


def last_call(engine, model) -> dict:
    """What Compile Model's last call of `model` ran: its block calls, compiled and eager by reason."""
    return engine.REGISTRY.stats()["last_calls"][f"{type(model.model).__name__}@{id(model.model):x}"]


def deepcache_report(accel_pack) -> dict:
    """The last DeepCache run's report (run_state.RunState.report), as the pack's telemetry recorded it."""
    events = [e for e in accel_pack.accel.telemetry.snapshot()["events"]
              if e["feature"] == "deepcache" and e["action"] == "run"]
    assert events, "no DeepCache run was reported"
    return events[-1]
