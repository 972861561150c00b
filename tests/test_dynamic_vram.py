"""Dynamic VRAM (ComfyUI 0.33+ on NVIDIA, comfy-aimdo) and the pack's features (accel/dynamic_vram.py,
docs/dynamic_vram.md): Compile Model, Compile VAE and Swap Weights leave it through the dynamic patcher's own
`get_non_dynamic_delegate()`, DeepCache keeps it; a model that cannot leave runs eagerly with one warning naming
`--disable-dynamic-vram`, and the node's status line says which way the model runs.

On 0.33 the features meet a real `ModelPatcherDynamic` in a fresh process (tests/dynamic_vram_probe.py: aimdo's
library loaded first, as main.py does). A CPU cannot give it a VBAR (aimdo's devices need a CUDA driver), so it
names a CUDA load device nothing loads to: clones, delegates, status lines and the eager path run for real, the
per-op faulting does not (a GPU measures that: docs/dynamic_vram.md). On 0.3.75, which has no dynamic VRAM,
those tests skip by name and the pass-through is tested instead.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.harness.child import read_result

PROBE = Path(__file__).with_name("dynamic_vram_probe.py")
FLAG = "--disable-dynamic-vram"


def has_dynamic_vram() -> bool:
    import comfy.model_patcher

    return hasattr(comfy.model_patcher, "ModelPatcherDynamic")


@pytest.fixture(scope="module")
def facts(comfy_dir, tmp_path_factory) -> dict:
    if not has_dynamic_vram():
        pytest.skip("this ComfyUI has no ModelPatcherDynamic (dynamic VRAM came with comfy-aimdo after 0.3.75): "
                    "the pass-through is tested by test_regular_model_passes_through")
    folder = tmp_path_factory.mktemp("dynamic-vram")
    done = subprocess.run([sys.executable, str(PROBE), str(folder)], capture_output=True, text=True, timeout=900)
    result = read_result(done.stdout)
    assert done.returncode == 0 and result is not None, done.stderr[-4000:]
    return result


def test_a_model_patcher_dynamic_is_built_on_the_cpu(facts):
    """What a CPU allows: aimdo's library loads, its devices do not (no CUDA driver), a CPU load device is sent to
    a plain ModelPatcher by ModelPatcherDynamic itself; one naming a CUDA device is a real ModelPatcherDynamic."""
    assert facts["aimdo_loaded"] and not facts["aimdo_devices"]
    assert facts["cpu_load_device_reroutes"] == "ModelPatcher"
    assert facts["built"] == {"type": "ModelPatcherDynamic", "is_dynamic": True, "clone_type": "ModelPatcherDynamic"}


def test_compile_model_leaves_dynamic_vram_once_per_input(facts):
    """Compile Model's clone is a regular ModelPatcher of a reloaded model (the delegate core's hooks use), the
    input untouched; a second application reuses that copy instead of loading a third; the status says so."""
    left = facts["compile_left"]
    assert left["type"] == "ModelPatcher" and not left["is_dynamic"] and not left["same_model_as_input"]
    assert left["second_same_model"] and left["delegate_cached"] and left["has_wrapper"]
    assert left["reloaded_output_equal"]  # the reloaded model computes what the loader's did
    assert left["status"]["dynamic_vram"] == "left" and "dynamic VRAM left" in left["status"]["text"]
    assert left["status"]["state"] == "waiting"  # and otherwise as ever: it compiles at the first step


def test_compile_model_that_cannot_leave_runs_eagerly_with_one_warning(facts):
    """No loader to replay (a custom loader: cached_patcher_init None): the model stays dynamic and every call
    runs eagerly, equal to eager, never traced (Dynamo's frame counter unmoved), one warning naming the flag."""
    kept = facts["compile_kept"]
    assert kept["type"] == "ModelPatcherDynamic" and kept["same_model_as_input"]
    assert kept["equal_to_eager"] and kept["dynamo_frames"] == 0
    assert len(kept["warnings"]) == 1 and FLAG in kept["warnings"][0]
    assert kept["status"]["state"] == "eager" and kept["status"]["dynamic_vram"] == "kept"
    assert FLAG in kept["status"]["text"]


def test_compile_model_never_traces_a_model_running_dynamic(facts):
    """Whatever made it so, a call whose current patcher is dynamic (ComfyUI's pre_run set it) runs eagerly."""
    running = facts["compile_running_dynamic"]
    assert running["equal_to_eager"] and running["dynamo_frames"] == 0
    assert len(running["warnings"]) == 1 and FLAG in running["warnings"][0]
    assert running["status"]["state"] == "eager" and "dynamic VRAM" in running["status"]["text"]


def test_deepcache_keeps_dynamic_vram(facts):
    deepcache = facts["deepcache"]
    assert deepcache["type"] == "ModelPatcherDynamic" and deepcache["same_model_as_input"]
    assert deepcache["message"].endswith("dynamic VRAM kept")


def test_swap_weights_leaves_dynamic_vram_or_names_the_fix(facts):
    assert facts["swap_left"] == {"type": "ModelPatcher", "is_dynamic": False, "same_model_as_input": False}
    assert FLAG in facts["swap_kept_error"] and "core loader" in facts["swap_kept_error"]


def test_compile_vae_leaves_dynamic_vram_with_its_own_model(facts):
    """The copy's first-stage model is its patcher's (the reloaded one): decode must run the model that patcher
    loads, with the compiled methods patched on it; the input VAE stays dynamic."""
    left = facts["vae_left"]
    assert not left["is_dynamic"] and left["model_is_patchers"] and not left["same_model_as_input"]
    assert left["input_untouched"] and left["methods_patched"] == ["decode", "encode"]
    assert left["status"]["dynamic_vram"] == "left"


def test_compile_vae_that_cannot_leave_codes_eagerly(facts):
    kept = facts["vae_kept"]
    assert kept["is_dynamic"] and kept["methods_patched"] == []  # nothing compiled under aimdo's casts
    assert kept["status"]["state"] == "eager" and FLAG in kept["status"]["text"]
    assert len(kept["warnings"]) == 1


def test_core_prefetch_path_is_off_on_the_cpu(facts):
    """comfy/model_prefetch.py's queue (and with it core's block CUDA graphs) never starts on a CPU."""
    assert facts["prefetch_queue_on_cpu"] is None


def test_regular_model_passes_through(engine, accel_pack, comfy_nodes):
    """A model that is not dynamic (0.3.75, a CPU, --disable-dynamic-vram) keeps its base model through every
    feature, and no status line or message mentions dynamic VRAM (0.3.75's clone() takes no disable_dynamic:
    calling it would raise)."""
    from compile_helpers import load

    model = load(comfy_nodes)
    dynamic_vram = accel_pack.accel.dynamic_vram
    assert not dynamic_vram.is_dynamic(model)
    assert dynamic_vram.leave(model, "test") == (model, None)
    compiled = engine.compile_model(model, engine.CompileOptions(), owner="regular-node")
    assert compiled.model is model.model
    status = engine.status.owner_statuses()["regular-node"]
    assert "dynamic_vram" not in status and "dynamic VRAM" not in status["text"]
    cached, _, message = accel_pack.accel.deepcache.apply(model, accel_pack.accel.deepcache.DeepCacheConfig())
    assert cached.model is model.model and "dynamic VRAM" not in message
    if not has_dynamic_vram():
        assert not hasattr(model, "is_dynamic")  # 0.3.75: the pack's check must not need it
