"""End to end on a started ComfyUI server with the pack in custom_nodes: HTTP API and comfy-cli."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.comfy_server import load_workflow

pytestmark = pytest.mark.server
WORKFLOW = "accel_txt2img_api.json"
ACCEL_NODES = {"AccelCompileModel": "Compile Model", "AccelCompileVAE": "Compile VAE",
               "AccelDeepCache": "DeepCache", "AccelSwapWeights": "Swap Weights"}


def assert_png(path: Path) -> None:
    from PIL import Image

    assert path.is_file(), f"no image at {path}"
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == (256, 256)


def test_object_info_lists_the_pack_nodes(comfy_server):
    info = comfy_server.get_json("/object_info")
    for node_id, display in ACCEL_NODES.items():
        assert node_id in info, f"{node_id} missing from /object_info"
        assert display in info[node_id]["display_name"]
        assert info[node_id]["category"].startswith("Accel")
    assert "accel-sd15-small.safetensors" in info["AccelSwapWeights"]["input"]["required"]["weights_file"][0]


def test_web_extension_served(comfy_server):
    scripts = comfy_server.get_json("/extensions")
    assert any(s.endswith("/accel.js") for s in scripts), scripts


def test_example_workflow_writes_an_image_over_http(comfy_server):
    before = comfy_server.get_json("/accel/stats")["counters"]
    entry = comfy_server.run_workflow(load_workflow(WORKFLOW))
    images = comfy_server.output_images(entry)
    assert len(images) == 1
    assert_png(images[0])
    stats = comfy_server.get_json("/accel/stats")
    after = stats["counters"]
    for key in ("compile_model.applied", "compile_vae.applied"):
        assert after.get(key, 0) == before.get(key, 0) + 1, (key, before, after)
    # The compiled-graph registry served the UNet's blocks and the VAE, each kind on a chosen path.
    kinds = {k["kind"]: k for k in stats["compile"]["kinds"]}
    assert any(name.startswith("ResBlock") for name in kinds) and any(".decode" in name for name in kinds)
    assert all(k["path"] in ("compiled", "eager") for k in kinds.values())
    for key in ("deepcache.applied", "deepcache.run"):  # applied once, then one sampling run
        assert after.get(key, 0) == before.get(key, 0) + 1, (key, before, after)
    run = [e for e in stats["events"] if e["feature"] == "deepcache" and e["action"] == "run"][-1]
    assert run["status"] == "completed" and run["reused_steps"] == 4 and run["steps"] == 6  # interval 3


def test_bad_workflow_is_refused_with_node_errors(comfy_server):
    graph = load_workflow(WORKFLOW)
    graph["1"]["inputs"]["unet_name"] = "no-such-model.safetensors"
    with pytest.raises(Exception) as err:
        comfy_server.queue_prompt(graph)
    assert "no-such-model.safetensors" in str(err.value)


def test_example_workflow_through_comfy_cli(comfy_server, tmp_path):
    graph = load_workflow(WORKFLOW)
    graph["8"]["inputs"]["seed"] = 7  # another seed, so ComfyUI's output cache cannot answer for it
    graph["12"]["inputs"]["filename_prefix"] = "accel-cli"
    workflow = tmp_path / "workflow_api.json"
    workflow.write_text(json.dumps(graph))
    comfy = Path(sys.executable).with_name("comfy")
    proc = subprocess.run(
        [str(comfy), "--skip-prompt", "run", "--workflow", str(workflow), "--wait",
         "--host", "127.0.0.1", "--port", str(comfy_server.port), "--timeout", "300"],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**__import__("os").environ, "HOME": str(tmp_path)})  # comfy-cli keeps its config under HOME
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = sorted((comfy_server.base_dir / "output").glob("accel-cli_*.png"))
    assert len(written) == 1, proc.stdout[-3000:]
    assert_png(written[0])
