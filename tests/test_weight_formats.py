"""Compile Model, DeepCache, Swap Weights and LoRAs on weights as people store them (issue #70, item 2): fp8
e4m3fn and e5m2 through UNETLoader's `weight_dtype`, an fp8 "scaled" checkpoint (ComfyUI's `scaled_fp8` format)
and GGUF quants (Q8_0, Q4_0) through city96's ComfyUI-GGUF, on the small SD1.5 UNet, and fp8 on Flux.

The quantized files are written from the generated model into this run's temp folder (tools/quant_models.py);
ComfyUI-GGUF is linked into a temp custom_nodes folder and loaded by ComfyUI's own custom-node loader, as a server
loads it. On the CPU ComfyUI runs fp8 and GGUF matrix products upcast to float32 (the weights dequantized per
call, inside the compiled blocks): what is checked here is correctness, speed needs a GPU.

Each format: the loaded model really holds that format; always-compiled output equals eager on the same weights
(the compiled tolerance: the dequantization is the same code, compiled), every block ran compiled and the status
says so, a repeated prompt compiles nothing (Dynamo's own counter); a LoRA on top changes the output and equals
the eager LoRA; DeepCache at interval 1 equals the format's eager output and at interval 3 reuses features; Swap
Weights swaps plain-tensor weights (fp8 weight_dtype: equal to the other file loaded as fp8) and refuses a
quantized tensor format with a message naming it, the model untouched.
"""
from __future__ import annotations

import pytest
import torch

from compile_helpers import SMALL, SMALL_B, assert_close_to_eager, deepcache_report, dynamo_frames, own_kinds, sample
from tools import quant_models

LORA = "accel-sd15-lora.safetensors"
SCALED = "accel-sd15-small-fp8-scaled.safetensors"
GGUF_FILES = {"gguf Q8_0": "accel-sd15-small-Q8_0.gguf", "gguf Q4_0": "accel-sd15-small-Q4_0.gguf"}
ALL_FORMATS = ("fp8_e4m3fn", "fp8_e5m2", "fp8 scaled", *GGUF_FILES)
# Each format's blocks are kinds of their own (a kind's key holds its weights' dtypes): compiled once per format,
# every one in make test (issue #70: e4m3fn and e5m2 by weight_dtype, ComfyUI's scaled fp8, GGUF Q8_0 and Q4_0).


@pytest.fixture(scope="module")
def format_files(comfy_dir, tmp_path_factory):
    """The quantized files of the small UNet, in a folder added to ComfyUI's diffusion_models paths, and
    ComfyUI-GGUF loaded from a temp custom_nodes folder."""
    import folder_paths
    import nodes

    folder = tmp_path_factory.mktemp("weight-formats")
    state_dict = quant_models.generated_state_dict(comfy_dir, SMALL)
    quant_models.write_scaled_fp8(state_dict, folder / SCALED)
    for label, name in GGUF_FILES.items():
        quant_models.write_gguf(state_dict, folder / name, "sd1", label.split()[1])
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    quant_models.load_gguf_nodes(tmp_path_factory.mktemp("custom_nodes"))
    assert "UnetLoaderGGUF" in nodes.NODE_CLASS_MAPPINGS, "ComfyUI-GGUF's nodes did not load (see the log)"
    return folder


def load_format(comfy_nodes, fmt: str, name: str = SMALL):
    """The model in `fmt`, through the loader a user would take: UNETLoader (its weight_dtype), or ComfyUI-GGUF's."""
    if fmt.startswith("fp8_"):
        return comfy_nodes.UNETLoader().load_unet(name, fmt)[0]
    if fmt == "fp8 scaled":
        return comfy_nodes.UNETLoader().load_unet(SCALED, "default")[0]
    return comfy_nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(GGUF_FILES[fmt])[0]


def stored_as(model) -> set[str]:
    """How the model keeps its weights: the dtypes of plain tensors, the type names of others, "scale_weight"
    where a layer carries ComfyUI's fp8 scale (0.3.75's scaled_fp8 ops)."""
    found = set()
    for module in model.model.diffusion_model.modules():
        if getattr(module, "scale_weight", None) is not None:
            found.add("scale_weight")
        for param in module.parameters(recurse=False):
            kind = type(param)
            found.add(str(param.dtype) if kind in (torch.Tensor, torch.nn.Parameter) else kind.__name__)
    return found


EXPECTED_STORAGE = {"fp8_e4m3fn": {"torch.float8_e4m3fn"}, "fp8_e5m2": {"torch.float8_e5m2"},
                    "gguf Q8_0": {"GGMLTensor"}, "gguf Q4_0": {"GGMLTensor"}}


@pytest.fixture(scope="module")
def plain(comfy_nodes):
    model = comfy_nodes.UNETLoader().load_unet(SMALL, "default")[0]
    return model, sample(model)


@pytest.fixture(scope="module")
def runs(comfy_nodes, engine, format_files, plain):
    """Per format, made once: the loaded model, its eager output, its always-compiled clone and that clone's
    first output (the format's blocks compiled here: shared by the tests below)."""
    made = {}

    def get(fmt: str) -> dict:
        if fmt not in made:
            model = load_format(comfy_nodes, fmt)
            eager = sample(model)
            compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
            made[fmt] = dict(model=model, eager=eager, compiled=compiled, compiled_out=sample(compiled))
        return made[fmt]

    return get


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_compiled_equals_eager_on_the_same_weights_and_the_repeat_compiles_nothing(engine, runs, plain, fmt):
    run = runs(fmt)
    storage = stored_as(run["model"])
    expected = EXPECTED_STORAGE.get(fmt) or {"scale_weight", "QuantizedTensor"}  # scaled: 0.3.75's ops or 0.33's
    assert storage & expected, f"{fmt}: the model holds {storage}, not the format"
    assert not torch.allclose(run["eager"], plain[1]), f"{fmt}: the quantized weights gave the float32 output"
    assert torch.isfinite(run["eager"]).all()
    assert_close_to_eager(run["compiled_out"], run["eager"], f"{fmt}: always compiled")
    compiled = run["compiled"]
    kinds = own_kinds(engine, compiled, "always compiled")
    n = len(kinds)
    status = engine.status.model_status(compiled.model, "always compiled")
    assert n and status["state"] == "compiled" and status["text"].startswith(f"{n} of {n} kinds compiled"), status
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled), run["eager"], f"{fmt}: always compiled, repeat")
    assert dynamo_frames() == frames, f"{fmt}: the repeated prompt compiled again"
    label = f"{type(compiled.model).__name__}@{id(compiled.model):x}"
    last = engine.REGISTRY.stats()["last_calls"][label]
    assert last["blocks"] and last["compiled"] == last["blocks"] and not last["eager"], last


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_a_lora_on_top_applies_under_compile_as_eagerly(comfy_nodes, runs, fmt):
    """Load (format) -> Compile Model -> LoRA, against Load (format) -> LoRA: the LoRA changes the output, the
    compiled output equals the eager one, and its repeat compiles nothing."""
    run = runs(fmt)
    lora = comfy_nodes.LoraLoaderModelOnly()
    eager = sample(lora.load_lora_model_only(run["model"], LORA, 1.0)[0])
    assert not torch.allclose(eager, run["eager"]), f"{fmt}: the LoRA changed nothing"
    compiled = lora.load_lora_model_only(run["compiled"], LORA, 1.0)[0]
    assert_close_to_eager(sample(compiled), eager, f"{fmt}: compiled, LoRA on top")
    frames = dynamo_frames()
    assert_close_to_eager(sample(compiled), eager, f"{fmt}: compiled, LoRA on top, repeat")
    assert dynamo_frames() == frames, f"{fmt}: the repeated LoRA prompt compiled again"


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_deepcache_reuses_features_on_the_format(accel_pack, runs, fmt):
    """Interval 1 is the format's own eager output exactly; interval 3 reuses deep features on 4 of 6 steps."""
    run = runs(fmt)
    node = accel_pack.nodes.deepcache.DeepCache()
    assert torch.equal(sample(node.apply(run["model"], 1, 1, 0.0, 1.0, "uniform")[0]), run["eager"]), fmt
    out = sample(node.apply(run["model"], 3, 1, 0.0, 1.0, "uniform")[0], steps=6)
    report = deepcache_report(accel_pack)
    assert report["status"] == "completed" and report["reused_steps"] == 4, report
    assert torch.isfinite(out).all()


def test_swap_weights_on_fp8_weights_equals_the_other_file_loaded_as_fp8(accel_pack, comfy_nodes, runs):
    """fp8 weight_dtype weights are plain fp8 tensors: Swap Weights converts the other file's as it copies them,
    as UNETLoader converts them, so the swapped compiled model equals that file loaded as fp8, eagerly."""
    run = runs("fp8_e4m3fn")
    reference = sample(load_format(comfy_nodes, "fp8_e4m3fn", SMALL_B))
    node = accel_pack.nodes.swap_weights.SwapWeights()
    swapped = node.apply(run["compiled"], SMALL_B)[0]
    frames = dynamo_frames()
    assert_close_to_eager(sample(swapped), reference, "fp8 compiled, swapped to B")
    assert dynamo_frames() == frames, "the swap compiled"
    assert_close_to_eager(sample(run["compiled"]), run["eager"], "the input model again")


@pytest.mark.parametrize("fmt, named", [("fp8 scaled", "fp8 scaled"), ("gguf Q8_0", "GGUF")])
def test_swap_weights_refuses_a_quantized_format_naming_it(accel_pack, comfy_nodes, format_files, fmt, named):
    """Weights kept in a quantized tensor format (ComfyUI's scaled fp8, ComfyUI-GGUF's GGMLTensor) cannot take a
    plain copy: GGMLTensor drops it with a warning (the old weights stay: a wrong picture), a scaled weight would
    lose its scale. Swap Weights refuses before anything changes, naming the format and what to do."""
    model = load_format(comfy_nodes, fmt)
    eager = sample(model)
    node = accel_pack.nodes.swap_weights.SwapWeights()
    with pytest.raises(ValueError, match=named) as refused:
        node.apply(model, SMALL_B)
    assert "UNETLoader" in str(refused.value)
    assert torch.equal(sample(model), eager), "the refused swap changed the model"


# Flux's 3072-wide blocks compile again in fp8 (their kinds are new: a kind's key holds its weights' dtype): Flux
# in fp8 is the usual set-up on consumer GPUs, so make test pays it.
def test_flux_fp8_weights_compile_equal_eager_and_take_a_lora(engine, comfy_nodes):
    """Flux (the generated 3072-wide model) loaded as fp8 e4m3fn, the usual Flux set-up on consumer GPUs: always
    compiled equals eager, a repeat compiles nothing, and a LoRA on top applies as it does eagerly."""
    from tools.families import BY_FAMILY
    from tools.families import sample as sample_family

    flux = BY_FAMILY["flux"]
    model = comfy_nodes.UNETLoader().load_unet(flux.file_name, "fp8_e4m3fn")[0]
    assert "torch.float8_e4m3fn" in stored_as(model)
    eager = sample_family(model, flux, steps=1)
    compiled = engine.compile_model(model, engine.CompileOptions(choose="always compiled"))
    assert_close_to_eager(sample_family(compiled, flux, steps=1), eager, "Flux fp8: always compiled")
    lora = comfy_nodes.LoraLoaderModelOnly()
    eager_lora = sample_family(lora.load_lora_model_only(model, "accel-flux-lora.safetensors", 1.0)[0], flux, steps=1)
    assert not torch.allclose(eager_lora, eager), "the Flux LoRA changed nothing"
    frames = dynamo_frames()
    compiled_lora = lora.load_lora_model_only(compiled, "accel-flux-lora.safetensors", 1.0)[0]
    assert_close_to_eager(sample_family(compiled_lora, flux, steps=1), eager_lora, "Flux fp8: LoRA on top")
    assert_close_to_eager(sample_family(compiled, flux, steps=1), eager, "Flux fp8: repeat")
    assert dynamo_frames() == frames, "Flux fp8: the LoRA or the repeat compiled"
