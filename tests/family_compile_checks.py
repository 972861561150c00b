"""Compile Model on one generated model family, as test_compile_families.py (image models) and
test_compile_video_families.py (video models, and the other options) check it: two files so that CI's two test
processes share the families (pytest-xdist gives each file to one process).

With every default (choose=auto, background compile) and with choose=always compiled, the output equals eager
within the compiled tolerance, the background child's graphs are loaded, the repeat compiles nothing, no
compiled block breaks into several graphs (check_compile_model_on_family); a prompt-length sweep and a size sweep
each cost at most one compile per kind and call variant, then none (check_sweep: SWEEPS). Compiles are counted
with Dynamo's own counter, as a change over what each step does.
"""
from __future__ import annotations

import os

import torch

from compile_helpers import assert_close_to_eager, dynamo_frames, dynamo_graph_breaks, own_kinds
from tools.families import FAMILIES, FamilyCase, load, sample
from tools.family_models import BY_NAME

# The split between the two files; every family is in one of them but Flux, whose 3072-wide compile CI pays
# once: its defaults through a started server (test_server_families.py), always compiled with what users put
# around it (test_compile_flux.py, which also asserts this module's always-compiled checks on it).
IMAGE_FAMILIES = [f for f in FAMILIES if (len(f.latent_shape) == 4 or f.name == "qwen_image")  # Qwen: one frame
                  and f.name != "flux"]
VIDEO_FAMILIES = [f for f in FAMILIES if len(f.latent_shape) == 5 and f.name != "qwen_image"]

# The sweeps compile dynamic graphs (20-45 s each here): make test sweeps prompt lengths on a DiT with double
# and single blocks and a token refiner (HunyuanVideo: narrow, where Flux's 3072-wide graphs cost a minute more);
# the full tier also sizes on Wan 2.1 (make test changes Wan 2.2's frames, size and batch under the defaults, and
# a UNet's latent width in test_compile_model.py). ACCEL_ALL_SWEEPS=1 sweeps both on every family.
SWEEPS = ([(f.name, n) for f in FAMILIES for n in ("tokens", "latent_shape")] if os.environ.get("ACCEL_ALL_SWEEPS")
          else [("hunyuan_video", "tokens"), ("wan21", "latent_shape")])
# Measured exceptions to "one compile per kind and call variant": HunyuanVideo's token refiner compiles its
# dynamic graph twice on the first longer prompt (the second after a guard on an input that is None).
EXTRA_SWEEP_COMPILES = {("hunyuan_video", "tokens"): 1}


def sweep(model, family, **changes) -> int:
    """Dynamo frames compiled over one sampling per value of one input (a prompt length, a latent size)."""
    (name, values), = changes.items()
    frames = dynamo_frames()
    for value in values:
        sample(model, family, steps=1, **{name: value})
    return dynamo_frames() - frames


def load_and_sample_eagerly(comfy_nodes, family: FamilyCase):
    """The generated file is the family's model to ComfyUI's own loader, and samples deterministically. Returns
    the model and its eager output."""
    model = load(comfy_nodes, family)
    assert type(model.model).__name__ == family.model_class
    assert type(model.model.model_config).__name__ == BY_NAME[family.name].detected
    assert len(family.latent_shape) == model.model.latent_format.latent_dimensions + 2
    assert family.latent_shape[1] == model.model.latent_format.latent_channels
    eager = sample(model, family)
    assert eager.shape == family.latent_shape and torch.isfinite(eager).all() and eager.std() > 1e-3
    assert torch.equal(sample(model, family, steps=1), sample(model, family, steps=1)), "eager is not deterministic"
    return model, eager


def check_always_compiled(engine, model, family: FamilyCase, eager):
    """choose=always compiled: compiled from the first call (compiled here, or served by the precompiled graphs
    the defaults' child saved for the same kinds), equal to eager, one graph per kind, the node's status, and a
    repeat that compiles nothing. Returns the compiled model and its kinds' stats."""
    breaks = dynamo_graph_breaks()
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    assert_close_to_eager(sample(always, family), eager, f"{family.name}: always compiled")
    always_kinds = own_kinds(engine, always, "always compiled")
    assert always_kinds and all(k["compiles"] >= 1 or k["precompiled"]["calls"] >= 1 for k in always_kinds), \
        always_kinds
    labels = [k["kind"] for k in always_kinds]
    assert len(set(labels)) == len(labels), f"two kinds share a label: {labels}"
    n = len(always_kinds)
    status = engine.status.model_status(always.model, "always compiled")
    assert status["state"] == "compiled" and status["text"].startswith(f"{n} of {n} kinds compiled"), status
    # Each kind is one graph: no per-call read of free memory by ComfyUI's CPU attention (replaced inside compiled
    # blocks, also where a block takes its transformer_options through **kwargs, as SD3's does), nothing else.
    assert dynamo_graph_breaks() == breaks, f"{family.name}: a compiled block broke into several graphs"
    frames = dynamo_frames()
    assert_close_to_eager(sample(always, family), eager, f"{family.name}: always compiled, repeat")
    assert dynamo_frames() == frames, "the repeat compiled again"
    return always, always_kinds


def check_compile_model_on_family(engine, comfy_nodes, family: FamilyCase) -> None:
    """What test_compile_families.py and test_compile_video_families.py assert for each family."""
    model, eager = load_and_sample_eagerly(comfy_nodes, family)

    # Every default: choose=auto, cold kinds compiled by a child process while the blocks run eagerly.
    breaks = dynamo_graph_breaks()
    auto = engine.compile_model(model, engine.CompileOptions())
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, first sampling")
    assert engine.background.BACKGROUND.wait(timeout=900), "the background compile did not finish"
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, with the child's graphs")
    kinds = own_kinds(engine, auto, "auto")
    assert kinds, "Compile Model found no blocks to compile"
    labels = [k["kind"] for k in kinds]
    assert len(set(labels)) == len(labels), f"two kinds share a label: {labels}"
    assert not [k for k in kinds if k["background"]["state"] == "failed"], kinds
    # what the Compile Model node says in the web UI (nodes/status.py): no longer compiling, every kind counted
    status = engine.status.model_status(auto.model)
    assert status["state"] in ("loading", "checking", "compiled", "eager"), status
    assert status["progress"]["total"] == len(kinds), (status, kinds)
    assert dynamo_graph_breaks() == breaks, f"{family.name}: a block loaded from the child broke into graphs"

    # choose=always compiled: compiled from the first call (the same graphs: choose is not part of the key).
    check_always_compiled(engine, model, family, eager)
    frames = dynamo_frames()
    assert_close_to_eager(sample(auto, family), eager, f"{family.name}: defaults, repeat")
    assert dynamo_frames() == frames, "the defaults' repeat compiled again"


def sweep_values(family: FamilyCase, name: str) -> list:
    """Prompt lengths of 1, 2 and 3 times the family's, or its latent and two larger sizes."""
    if name == "tokens":
        return [family.tokens, 2 * family.tokens, 3 * family.tokens]
    shape = family.latent_shape
    return [shape, (*shape[:-2], shape[-2] + 8, shape[-1] + 8), (*shape[:-2], shape[-2] + 8, shape[-1] + 16)]


def check_sweep(engine, comfy_nodes, family: FamilyCase, name: str) -> None:
    """A prompt-length ("tokens") or latent-size ("latent_shape") sweep under always compiled: at most one more
    compile per kind and call variant, then none; the last value equals eager. (A variant is a way the model calls
    a kind apart from sizes: Wan's first block gets its input transposed, the others do not; HunyuanVideo's token
    refiner is called with and without a mask.)"""
    model = load(comfy_nodes, family)
    always = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    sample(always, family, steps=1)  # the family's own shapes first (compiled by the family's test, if it ran here)
    graphs = sum(k["call_variants"] for k in own_kinds(engine, always, "always compiled"))
    values = sweep_values(family, name)
    first = sweep(always, family, **{name: values})
    allowed = graphs + EXTRA_SWEEP_COMPILES.get((family.name, name), 0)
    assert first <= allowed, f"{family.name}: the {name} sweep compiled {first} times for {graphs} call variants"
    assert sweep(always, family, **{name: values}) == 0, f"{family.name}: the repeated {name} sweep compiled"
    assert_close_to_eager(sample(always, family, **{name: values[-1]}), sample(model, family, **{name: values[-1]}),
                          f"{family.name}: after the {name} sweep")
