"""Compile Model on Flux (the generated 2 double + 2 single block model, 3072 wide): always compiled, checked as
every family is (family_compile_checks.py), and with what users put around it: LoRAs at changing strengths and
files, another node's replacement of a DiT block (PuLID-style `patches_replace`), another node's attention
override, and a partially loaded model (ComfyUI's lowvram path). Each output equals eager; nothing recompiles per
step, strength or file.
"""
from __future__ import annotations

import pytest
import torch

from compile_helpers import assert_close_to_eager, dynamo_frames
from tools.families import BY_FAMILY, sample
from family_compile_checks import check_always_compiled, load_and_sample_eagerly

FLUX = BY_FAMILY["flux"]
LORAS = ("accel-flux-lora.safetensors", "accel-flux-lora-2.safetensors")


@pytest.fixture(scope="module")
def flux_and_eager(comfy_nodes):
    return load_and_sample_eagerly(comfy_nodes, FLUX)


@pytest.fixture(scope="module")
def flux(flux_and_eager):
    return flux_and_eager[0]


def test_flux_always_compiled_equals_eager_in_one_graph_per_kind(engine, flux_and_eager):
    """test_compile_families.py's always-compiled checks, on Flux (its defaults: test_server_families.py)."""
    flux, eager = flux_and_eager
    check_always_compiled(engine, flux, FLUX, eager)


def with_lora(comfy_nodes, model, name: str, strength: float):
    (patched,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)
    return patched


@pytest.mark.full(why=(
    "LoRA strengths and files on Flux; make test applies a LoRA under Compile Model on Qwen-Image "
    "(test_templates.py's qwen_image_lightning_lora) and on each weight format "
    "(test_a_lora_on_top_applies_under_compile_as_eagerly), and changes weights without a recompile in "
    "test_swap_weights.py"))
def test_lora_strengths_and_files_under_compile_equal_eager_and_never_recompile(engine, comfy_nodes, flux):
    """Load -> LoRA -> Compile Model, as a user changes the LoRA's strength and file between prompts (the
    Compile Model node runs again on each new LoRA clone), and Load -> Compile Model -> LoRA."""
    options = engine.CompileOptions(choose="always compiled")
    compiled_base = engine.compile_model(flux, options)
    sample(compiled_base, FLUX, steps=1)  # compiles what this process has not compiled yet
    frames = dynamo_frames()
    outputs = {}
    for name, strength in ((LORAS[0], 0.0), (LORAS[0], 0.5), (LORAS[0], 1.0), (LORAS[1], 1.0)):
        eager = sample(with_lora(comfy_nodes, flux, name, strength), FLUX, steps=1)
        lora_then_compile = engine.compile_model(with_lora(comfy_nodes, flux, name, strength), options)
        compile_then_lora = with_lora(comfy_nodes, compiled_base, name, strength)
        for label, model in (("LoRA -> Compile", lora_then_compile), ("Compile -> LoRA", compile_then_lora)):
            assert_close_to_eager(sample(model, FLUX, steps=1), eager, f"{label}, {name} at {strength}")
        outputs[(name, strength)] = eager
    assert dynamo_frames() == frames, "a LoRA strength or file made Compile Model recompile"
    assert torch.equal(outputs[(LORAS[0], 0.0)], sample(flux, FLUX, steps=1)), "strength 0 changed the model"
    assert not torch.allclose(outputs[(LORAS[0], 1.0)], outputs[(LORAS[0], 0.0)]), "the LoRA changed nothing"


def test_a_replaced_dit_block_runs_correctly_and_never_recompiles(engine, flux):
    """Another node replaces a double-stream block (as PuLID-style nodes do through patches_replace "dit"),
    calling the original block and changing its output: the model's loop calls the replacement, which calls the
    block (compiled, as the others); every step is correct and none recompiles."""
    def replace_block(args, extra):
        out = extra["original_block"](args)
        return {"img": out["img"] * 1.01, "txt": out["txt"]}

    eager = flux.clone()
    eager.set_model_patch_replace(replace_block, "dit", "double_block", 0)
    compiled = engine.compile_model(flux, engine.CompileOptions(choose="always compiled"))
    compiled.set_model_patch_replace(replace_block, "dit", "double_block", 0)
    reference = sample(eager, FLUX, steps=2)
    assert not torch.allclose(reference, sample(flux, FLUX, steps=2)), "the replacement changed nothing"
    assert_close_to_eager(sample(compiled, FLUX, steps=2), reference, "replaced block, first sampling")
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, FLUX, steps=2, seed=1), sample(eager, FLUX, steps=2, seed=1),
                          "replaced block, second sampling")
    assert dynamo_frames() == frames, "a replaced block made Compile Model recompile per step"


def test_an_attention_override_runs_those_calls_eagerly_and_correctly(engine, flux):
    """Another node overrides the attention (ComfyUI's `optimized_attention_override` in transformer_options, as
    attention-swapping nodes set it). A compiled graph would bake one override in, so the blocks run eagerly
    while it is set, with the reason in the stats: every step is correct, and nothing compiles per step."""
    def override(func, *args, **kwargs):
        return func(*args, **kwargs) * 1.01

    def with_override(model):
        patched = model.clone()
        patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
        return patched

    eager = with_override(flux)
    compiled = with_override(engine.compile_model(flux, engine.CompileOptions(choose="always compiled")))
    reference = sample(eager, FLUX, steps=2)
    assert not torch.allclose(reference, sample(flux, FLUX, steps=2)), "the override changed nothing"
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled, FLUX, steps=2), reference, "attention override, first sampling")
    assert_close_to_eager(sample(compiled, FLUX, steps=2, seed=1), sample(eager, FLUX, steps=2, seed=1),
                          "attention override, second sampling")
    assert dynamo_frames() == frames, "an attention override made Compile Model compile"
    label = f"{type(compiled.model).__name__}@{id(compiled.model):x}"
    last = engine.REGISTRY.stats()["last_calls"][label]
    assert last["compiled"] == 0 and last["eager"] == {"another node patched the attention or the UNet": 4}, last


def apply_flux(patcher, seed: int = 0):
    """One BaseModel.apply_model call with Flux's inputs and the patcher's wrappers, on the model in whatever load
    state the test put it in (the sampler would load it fully first)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 16, 16, generator=generator)
    context = torch.randn(1, 77, FLUX.context_dim, generator=generator)
    pooled = torch.randn(1, FLUX.pooled_dim, generator=generator)
    options = dict(patcher.model_options["transformer_options"])
    options["wrappers"] = patcher.wrappers
    with torch.no_grad():
        return patcher.model.apply_model(x, torch.full((1,), 0.8), c_crossattn=context, y=pooled,
                                         guidance=torch.full((1,), 3.5), transformer_options=options)


def test_partially_loaded_flux_samples_correctly_and_says_how_its_blocks_ran(engine, flux):
    """About half of Flux's weights loaded (ComfyUI's lowvram path: the rest cast per call): outputs equal the
    fully loaded eager model's, and the stats say how many blocks ran compiled and why any others did not."""
    compiled = engine.compile_model(flux, engine.CompileOptions(choose="always compiled"))
    device = compiled.load_device
    flux.patch_model(device_to=device)
    reference = apply_flux(flux)
    flux.unpatch_model(flux.offload_device)
    try:
        compiled.patch_model(device_to=device, lowvram_model_memory=compiled.model_size() // 2)
        casting = [m for m in compiled.model.diffusion_model.modules() if getattr(m, "comfy_cast_weights", False)]
        assert casting, "the partial load left no module casting its weights per call"
        for seed in range(2):  # the second call is the steady state of this load
            assert_close_to_eager(apply_flux(compiled), reference, f"partially loaded, call {seed}")
        label = f"{type(compiled.model).__name__}@{id(compiled.model):x}"
        last = engine.REGISTRY.stats()["last_calls"][label]
        assert last["blocks"] == 4 and last["compiled"] + sum(last["eager"].values()) == 4, last
    finally:
        compiled.unpatch_model(compiled.offload_device)
