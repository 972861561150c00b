"""Swap Weights on the real ComfyUI: a compiled model takes another file's weights with no recompile, LoRA applies on
the swapped weights, a wrong architecture is refused before anything changes, a swap that fails or is interrupted
half-way leaves the original weights, offload states reload the right weights, and swaps never interleave.

Models come from ComfyUI's own loaders (UNETLoader, LoraLoaderModelOnly) and run through ComfyUI's sampler. Eager
references are separately loaded models of the same files. Compiles are counted with Dynamo's own counter.
"""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

from compile_helpers import SMALL, SMALL_B, apply_model, assert_close_to_eager, dynamo_frames, load, sample

LORA, LORA_2 = "accel-sd15-lora.safetensors", "accel-sd15-lora-2.safetensors"


@pytest.fixture(scope="module")
def ws(accel_pack):
    return accel_pack.accel.weight_swap



def lora(comfy_nodes, model, name, strength):
    (out,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, strength)
    return out


def weights(patcher) -> dict:
    return {k: v.detach().clone() for k, v in patcher.model.diffusion_model.state_dict().items()}


def assert_weights(patcher, expected: dict, what: str) -> None:
    current = patcher.model.diffusion_model.state_dict()
    different = [k for k, v in expected.items() if not torch.equal(current[k], v)]
    assert not different, f"{what}: {len(different)} tensors differ, first {different[:3]}"


def file_path(name: str) -> str:
    import folder_paths

    return folder_paths.get_full_path("diffusion_models", name)


def events(accel_pack, action: str, since: float = 0.0) -> list[dict]:
    """The pack's Swap Weights events of `action` (recorded at `since`, a time.time(), or later). The pack keeps
    the process's last MAX_EVENTS events, so a test reads its own by their time, never by counting: earlier tests
    of its process may have filled the ring, and each new event then drops the oldest."""
    return [e for e in accel_pack.accel.telemetry.snapshot()["events"]
            if e["feature"] == "swap_weights" and e["action"] == action and e["time"] >= since]


def node_swap(accel_pack, model, weights_file, weights_model=None):
    """The node as ComfyUI's executor calls it, with the workflow (hidden PROMPT) that leads to its model input."""
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SMALL, "weight_dtype": "default"}},
        "2": {"class_type": "AccelCompileModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "AccelSwapWeights", "inputs": {"model": ["2", 0], "weights_file": weights_file}},
    }
    node = accel_pack.nodes.swap_weights.SwapWeights()
    return node.apply(model, weights_file, weights_model, prompt=prompt, unique_id="3")[0]


@pytest.fixture(scope="module")
def eager(comfy_nodes):
    """Separately loaded eager models of both files: reference outputs, weights, and LoRA references."""
    a, b = load(comfy_nodes, SMALL), load(comfy_nodes, SMALL_B)
    return {"a": a, "b": b, "out_a": sample(a), "out_b": sample(b), "weights_a": weights(a), "weights_b": weights(b)}


@pytest.fixture(scope="module")
def compiled(accel_pack, comfy_nodes, eager):
    """A compiled model of file A, sampled once (its blocks compiled)."""
    engine = accel_pack.accel.compile
    model = engine.compile_model(load(comfy_nodes, SMALL), engine.CompileOptions(choose="always compiled"))
    def compiled_block_calls():  # compiles plus calls answered by already compiled code (kinds are shared)
        totals = engine.REGISTRY.stats()["totals"]
        return totals["compiles"] + totals["cache_hits"]

    before = compiled_block_calls()
    assert_close_to_eager(sample(model), eager["out_a"], "compiled A")
    assert compiled_block_calls() > before, "the compiled model ran no compiled block"
    return model


def test_a_b_a_on_a_compiled_model_equals_eager_and_compiles_nothing(accel_pack, compiled, eager):
    frames = dynamo_frames()
    to_b = node_swap(accel_pack, compiled, SMALL_B)
    assert to_b is not compiled and not compiled.get_attachment("accel.swap_weights"), "the input model changed"
    assert_close_to_eager(sample(to_b), eager["out_b"], "A -> B")
    assert_weights(to_b, eager["weights_b"], "B's weights after the swap")
    assert_close_to_eager(sample(compiled), eager["out_a"], "the input model again")
    assert_weights(compiled, eager["weights_a"], "A's weights back for the input model")
    back_to_a = node_swap(accel_pack, to_b, SMALL)
    assert_close_to_eager(sample(back_to_a), eager["out_a"], "A -> B -> A")
    assert_close_to_eager(sample(to_b), eager["out_b"], "B again")
    engine = accel_pack.accel.compile  # Swap Weights before Compile Model works the same
    swap_then_compile = engine.compile_model(node_swap(accel_pack, compiled.parent, SMALL_B),
                                             engine.CompileOptions(choose="always compiled"))
    assert_close_to_eager(sample(swap_then_compile), eager["out_b"], "swap, then compile")
    assert dynamo_frames() == frames, "a swap compiled"
    swapped = events(accel_pack, "swapped")
    assert swapped and swapped[-1]["origin"] == "file", "the loader's file was not used for the original weights"
    assert all(e["spilled"] == 0 for e in swapped if e["origin"] == "file")


def test_lora_on_swapped_weights_equals_eager_without_recompiles(accel_pack, comfy_nodes, compiled, eager):
    to_b = node_swap(accel_pack, compiled, SMALL_B)
    sample(to_b)
    frames = dynamo_frames()
    start = time.time()
    for name, strength in [(LORA, 0.0), (LORA, 0.5), (LORA, 1.0), (LORA_2, 1.0)]:
        out = sample(lora(comfy_nodes, to_b, name, strength), steps=2)
        reference = sample(lora(comfy_nodes, eager["b"], name, strength), steps=2)
        assert_close_to_eager(out, reference, f"B + {name} @ {strength}")
    assert dynamo_frames() == frames, "a LoRA strength or file change compiled"
    # Between swapped clones the swapped weights stay in place: a LoRA change re-patches the LoRA's keys only.
    assert sum(e["tensors"] for e in events(accel_pack, "swapped", since=start)) == 0, "a LoRA change streamed weights"
    sample(to_b)
    assert_weights(to_b, eager["weights_b"], "LoRA removed: B's weights bit for bit")
    # LoRA before Compile Model and Swap Weights: applied on the swapped weights too.
    engine = accel_pack.accel.compile
    lora_first = engine.compile_model(lora(comfy_nodes, eager["a"], LORA, 0.8),
                                      engine.CompileOptions(choose="always compiled"))
    out = sample(accel_pack.accel.weight_swap.swap_weights(lora_first, accel_pack.accel.weight_swap.WeightsFile(
        file_path(SMALL_B))))
    assert_close_to_eager(out, sample(lora(comfy_nodes, eager["b"], LORA, 0.8)), "LoRA, compile, then swap")
    assert dynamo_frames() == frames
    sample(eager["a"])
    assert_weights(eager["a"], eager["weights_a"], "the LoRA'd input's model back to A")


def write_mismatched(eager, path) -> None:
    """An SD1.5-like file that is not this architecture: an inpainting input layer (9 channels) and no middle block."""
    from safetensors.torch import save_file

    state = {"model.diffusion_model." + k: v.half() for k, v in eager["weights_b"].items()
             if not k.startswith("middle_block.")}
    state["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(320, 9, 3, 3, dtype=torch.float16)
    save_file(state, str(path))


def test_mismatched_architecture_is_refused_and_the_model_is_unchanged(ws, compiled, eager, tmp_path):
    before = sample(compiled)
    path = tmp_path / "inpaint-like.safetensors"
    write_mismatched(eager, path)
    with pytest.raises(ValueError) as err:
        ws.swap_weights(compiled, ws.WeightsFile(str(path)))
    text = str(err.value)
    assert text.startswith("Swap Weights: inpaint-like.safetensors does not fit this model (BaseModel")
    assert "of the model's weights are not in it (diffusion_model.middle_block.0.emb_layers.1.bias" in text
    assert ("1 tensor has another shape (diffusion_model.input_blocks.0.0.weight: [320, 9, 3, 3] here, "
            "[320, 4, 3, 3] in the model)") in text
    assert "Pick a file of the same architecture as the model" in text
    assert torch.equal(sample(compiled), before), "the refused swap changed the model's outputs"
    assert_weights(compiled, eager["weights_a"], "after a refused swap")


def test_a_checkpoint_that_samples_otherwise_is_refused(ws, comfy_nodes, tmp_path):
    """A v-prediction SDXL checkpoint (its "v_pred" key, as NoobAI-XL v-pred's) has an eps SDXL's keys and shapes,
    but ComfyUI's checkpoint loader samples it as v-prediction: swapped into an eps model it gave another picture
    than the file itself (found by a review: up to 529 off, outputs of 38). Refused, naming both; the same
    weights without the key are taken."""
    import comfy.utils
    from safetensors.torch import save_file

    (model,) = comfy_nodes.UNETLoader().load_unet("accel-tiny-sdxl.safetensors", "default")
    prefix = "model.diffusion_model."  # as a checkpoint holds them (the generated file may already)
    state = {(k if k.startswith(prefix) else prefix + k): v.contiguous()
             for k, v in comfy.utils.load_torch_file(file_path("accel-tiny-sdxl.safetensors")).items()}
    save_file(state, str(tmp_path / "eps.safetensors"))
    save_file({**state, "v_pred": torch.tensor([])}, str(tmp_path / "vpred.safetensors"))
    ws.swap_weights(model, ws.WeightsFile(str(tmp_path / "eps.safetensors")))
    with pytest.raises(ValueError) as err:
        ws.swap_weights(model, ws.WeightsFile(str(tmp_path / "vpred.safetensors")))
    assert str(err.value).startswith("Swap Weights: vpred.safetensors samples as V_PREDICTION (v_pred in the "
                                     "file) and this model as EPS"), err.value
    assert "Load Checkpoint" in str(err.value)
    import comfy.sd  # the same file loaded by ComfyUI's checkpoint loader, as a weights_model: refused too

    vpred = comfy.sd.load_checkpoint_guess_config(str(tmp_path / "vpred.safetensors"), output_vae=False,
                                                  output_clip=False)[0]
    with pytest.raises(ValueError, match="samples as V_PREDICTION and this model as EPS"):
        ws.swap_from_model(model, vpred)


class ProgressHook:
    """ComfyUI's global progress hook (what the server uses to report progress) running `action` at the swap's first
    progress report, which comes after its first tensor is written."""

    def __init__(self, action):
        self.action, self.fired = action, False

    def __call__(self, value, total, preview=None, node_id=None):
        if not self.fired and value < total:
            self.fired = True
            self.action()

    def __enter__(self):
        import comfy.utils

        self.previous = comfy.utils.PROGRESS_BAR_HOOK
        comfy.utils.set_progress_bar_global_hook(self)
        return self

    def __exit__(self, *exc):
        import comfy.model_management
        import comfy.utils

        comfy.utils.set_progress_bar_global_hook(self.previous)
        comfy.model_management.interrupt_current_processing(False)


def test_failure_half_way_leaves_the_old_weights(ws, accel_pack, compiled, eager, tmp_path):
    """The file is cut in the middle while the swap streams it (replaced by a download, a full disk...)."""
    path = tmp_path / "b-copy.safetensors"
    shutil.copyfile(file_path(SMALL_B), path)
    to_b = node_swap(accel_pack, compiled, SMALL_B)
    sample(to_b)  # B is in place: the failing swap starts from swapped weights, not from the original
    source = ws.WeightsFile(str(path))
    broken = ws.swap_weights(to_b, source)
    middle = sorted(i.start for i in source.infos.values())[len(source.infos) // 2]

    def cut_file():
        with open(path, "r+b") as f:
            f.truncate(middle)

    with ProgressHook(cut_file), pytest.raises(OSError, match="is truncated or being replaced"):
        sample(broken)
    failed = events(accel_pack, "rolled_back")[-1]
    assert len(source.infos) // 3 < failed["tensors_done"] < len(source.infos), failed
    assert_weights(compiled, eager["weights_a"], "right after the failed swap")
    assert_close_to_eager(sample(compiled), eager["out_a"], "the input model after a failed swap")
    assert_close_to_eager(sample(to_b), eager["out_b"], "the model swapped before")


def test_interrupt_during_a_swap_restores_the_old_weights(ws, accel_pack, compiled, eager):
    """ComfyUI's own interrupt (the queue's cancel, POST /interrupt), raised while the swap streams tensors."""
    import comfy.model_management

    to_b = ws.swap_weights(compiled, ws.WeightsFile(file_path(SMALL_B)))
    sample(compiled)
    with ProgressHook(comfy.model_management.interrupt_current_processing):
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            sample(to_b)
    failed = events(accel_pack, "rolled_back")[-1]
    assert failed["reason"].startswith("InterruptProcessingException") and failed["tensors_done"] > 0, failed
    assert_weights(compiled, eager["weights_a"], "right after the interrupted swap")
    assert_close_to_eager(sample(to_b), eager["out_b"], "the same swap, run again")
    assert_close_to_eager(sample(compiled), eager["out_a"], "the input model")


def test_swaps_in_every_offload_state_reload_the_right_weights(ws, compiled, eager):
    import comfy.model_management

    comfy.model_management.unload_all_models()  # every model unpatched: ComfyUI's own state between workflows
    a, b = eager["a"], eager["b"]
    load_device, offload_device = compiled.load_device, compiled.offload_device
    a.patch_model(device_to=load_device)
    reference_a = apply_model(a)
    a.unpatch_model(offload_device)
    b.patch_model(device_to=load_device)
    reference_b = apply_model(b)
    b.unpatch_model(offload_device)
    half = compiled.model_size() // 2

    # swapped while the input model is partially loaded, then loaded partially itself
    compiled.patch_model(device_to=load_device, lowvram_model_memory=half)
    to_b = ws.swap_weights(compiled, ws.WeightsFile(file_path(SMALL_B)))
    to_b.partially_load(load_device, half)
    assert compiled.model.model_lowvram, "the model did not load partially"
    assert_close_to_eager(apply_model(to_b), reference_b, "partially loaded")
    # part of it offloaded again (ComfyUI restores the original there), then reloaded fully
    to_b.partially_unload(offload_device, half // 2)
    to_b.partially_load(load_device, compiled.model_size())
    assert_close_to_eager(apply_model(to_b), reference_b, "after a partial unload and a full reload")
    # unloaded: ComfyUI restores the original weights; the next load swaps again
    to_b.unpatch_model(offload_device)
    assert_weights(compiled, eager["weights_a"], "unloaded")
    to_b.patch_model(device_to=load_device)
    assert_close_to_eager(apply_model(to_b), reference_b, "reloaded")
    to_b.unpatch_model(offload_device)
    compiled.patch_model(device_to=load_device)
    assert_close_to_eager(apply_model(compiled), reference_a, "the input model")
    compiled.unpatch_model(offload_device)


def test_concurrent_swaps_never_interleave(ws, accel_pack, comfy_nodes, eager):
    """Two threads, each swapping its own model back and forth: the swaps run one at a time, and each model ends
    with exactly the weights of its last swap."""
    models = [load(comfy_nodes, SMALL), load(comfy_nodes, SMALL)]
    swaps = [ws.swap_weights(m, ws.WeightsFile(file_path(SMALL_B))) for m in models]
    errors = []
    start = time.time()

    def run(model, swapped):
        try:
            for _ in range(3):
                swapped.patch_model(device_to=model.load_device)
                swapped.unpatch_model(model.offload_device)
            swapped.patch_model(device_to=model.load_device)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(models, swaps)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    spans = sorted((e["time"] - e["seconds"], e["time"]) for e in events(accel_pack, "swapped", since=start))
    assert len(spans) == 8, spans
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), f"overlapping: {spans}"
    for swapped in swaps:
        assert_weights(swapped, eager["weights_b"], "after concurrent swaps")
        swapped.unpatch_model(swapped.offload_device)


def test_original_weights_are_spilled_once_when_the_loader_file_is_unknown(ws, accel_pack, comfy_nodes, eager):
    import gc

    import comfy.model_management
    import comfy.sd
    import comfy.utils
    import folder_paths

    spill_dir = os.path.join(folder_paths.get_temp_directory(), "accel-swap-weights")
    before = set(os.listdir(spill_dir)) if os.path.isdir(spill_dir) else set()
    # Loaded from a state dict (as custom loaders do): its file is unknown, and a wrong guess (B's file as the
    # original) is caught by the content check.
    model = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(file_path(SMALL)))
    swapped = ws.swap_weights(model, ws.WeightsFile(file_path(SMALL_B)), origin_hints=[file_path(SMALL_B)])
    sample(swapped)
    first = events(accel_pack, "swapped")[-1]
    assert first["origin"] == "spill" and first["spilled"] == first["tensors"] == len(eager["weights_b"]), first
    (spill,) = set(os.listdir(spill_dir)) - before
    assert_close_to_eager(sample(model), eager["out_a"], "the input model, its weights read back from the spill")
    assert_weights(model, eager["weights_a"], "read back from the spill")
    sample(swapped)
    assert events(accel_pack, "swapped")[-1]["spilled"] == 0, "the originals were spilled twice"

    # ComfyUI empties its temp folder when it starts and exits: another ComfyUI on the same folder (one per GPU)
    # deletes the spill file. The originals it held still come back (before: a swap to another file then failed
    # to restore them, and the input model sampled with half of its weights swapped).
    shutil.rmtree(spill_dir)
    again = ws.swap_weights(model, ws.WeightsFile(file_path(SMALL)), origin_hints=[file_path(SMALL_B)])
    sample(swapped)
    assert_close_to_eager(sample(again), eager["out_a"], "swapped to A's file after the spill was deleted")
    assert_close_to_eager(sample(model), eager["out_a"], "the input model after the spill was deleted")
    assert_weights(model, eager["weights_a"], "read back after the spill was deleted")
    del model, swapped, again
    comfy.model_management.unload_all_models()
    gc.collect()
    assert not os.path.exists(os.path.join(spill_dir, spill)), "the spill file outlived its model"


def test_weights_model_input_and_node_errors(accel_pack, compiled, eager):
    node = accel_pack.nodes.swap_weights
    # a file Swap Weights cannot read is not offered (before, it was, and refused only when the workflow ran)
    pickle_file = os.path.join(os.path.dirname(file_path(SMALL)), "accel-not-safetensors.ckpt")
    with open(pickle_file, "wb") as f:
        f.write(b"\x80\x02}q\x00.")
    try:
        schema = node.SwapWeights.INPUT_TYPES()
    finally:
        os.remove(pickle_file)
    files = schema["required"]["weights_file"][0]
    assert files[0] == node.NO_FILE and SMALL_B in files and len(files) == len(set(files))
    assert not [f for f in files[1:] if not f.endswith((".safetensors", ".sft"))], files
    assert schema["optional"]["weights_model"][0] == "MODEL"
    out = node.SwapWeights().apply(compiled, node.NO_FILE, eager["b"])[0]
    assert_close_to_eager(sample(out), eager["out_b"], "weights from a second MODEL")
    back = node.SwapWeights().apply(out, node.NO_FILE, compiled)[0]
    assert_close_to_eager(sample(back), eager["out_a"], "weights_model = the model itself: its original weights")
    with pytest.raises(ValueError, match=r"both weights_file \(accel-sd15-small-b.safetensors\) and weights_model"):
        node.SwapWeights().apply(compiled, SMALL_B, eager["b"])
    with pytest.raises(ValueError, match="pick a weights_file, or connect weights_model"):
        node.SwapWeights().apply(compiled, node.NO_FILE)


def test_a_weights_file_rewritten_under_its_name_is_read_again_on_the_next_run(accel_pack, compiled, eager):
    """A fine-tune saved again under the same name: ComfyUI's executor asks the node's IS_CHANGED and runs the node
    again, which reads the new file. Before, the node had no IS_CHANGED: ComfyUI kept its output from the old file,
    whose reads refuse a changed file ("changed on disk"), at every run until an input changed. Its value holds
    while the file does not change, so the node does not run (and swap) again at every prompt."""
    import asyncio
    import copy

    import execution
    from comfy_execution.graph import DynamicPrompt

    name = "accel-sd15-rewritten.safetensors"
    path = os.path.join(os.path.dirname(file_path(SMALL)), name)
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": SMALL, "weight_dtype": "default"}},
        "2": {"class_type": "AccelCompileModel", "inputs": {"model": ["1", 0]}},
        "3": {"class_type": "AccelSwapWeights", "inputs": {"model": ["2", 0], "weights_file": name}},
    }

    def is_changed():  # what ComfyUI's executor compares with the last run's, to tell whether to run the node again
        cache = execution.IsChangedCache("prompt", DynamicPrompt(copy.deepcopy(prompt)), None)  # it notes its answer there
        return asyncio.run(cache.get("3"))

    def run_node():
        return accel_pack.nodes.swap_weights.SwapWeights().apply(compiled, name, prompt=prompt, unique_id="3")[0]

    shutil.copyfile(file_path(SMALL_B), path)
    try:
        first = is_changed()
        assert_close_to_eager(sample(run_node()), eager["out_b"], "B's weights under the new name")
        assert is_changed() == first, "the unchanged file would run the node (and swap) again at every prompt"
        shutil.copyfile(file_path(SMALL), path)  # rewritten in place: the same name, A's weights now
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later time, whatever the clock's grain
        assert is_changed() != first, "ComfyUI would keep the node's output from the old file"
        assert_close_to_eager(sample(run_node()), eager["out_a"], "the node run again on the rewritten file")
        assert_close_to_eager(sample(compiled), eager["out_a"], "the node's input model")
    finally:
        os.remove(path)
