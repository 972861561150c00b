"""Prompts that mix what users change between prompts, as API graphs for a started ComfyUI server, and what the
long-run tests read off that server: tests/test_soak.py, tests/test_faults.py and bench/soak.py use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tools.families import BY_FAMILY
from tools.comfy_server import ComfyServer

TEST_NODES = Path(__file__).with_name("server_nodes") / "accel_test_inputs"


@dataclass(frozen=True)
class Prompt:
    name: str
    model: str = "sd15"  # the small SD1.5 UNet, or "sd3" (the generated SD3 transformer)
    size: int = 128
    batch: int = 1
    cfg: float = 7.0
    deepcache: int = 0  # DeepCache's interval; 0: no DeepCache node
    lora: float = 0.0  # LoRA strength; 0: no LoRA node
    swap: bool = False  # Swap Weights to the second checkpoint of the same architecture
    compiled: bool = False  # Compile Model (at its defaults unless the next two say otherwise)
    choose: str = "auto"
    dynamic: str = "auto"  # Compile Model's dynamic input: each value is a compile key of its own
    background: bool = True
    advanced: bool = False  # KSamplerAdvanced instead of KSampler
    seed: int = 7
    steps: int = 6


CONFIGS = (
    Prompt("lora-half+compiled+deepcache3", lora=0.5, compiled=True, deepcache=3),
    Prompt("batch2-cfg1-lora-advanced", size=192, batch=2, cfg=1.0, lora=1.0, advanced=True),
    Prompt("sd3-compiled", model="sd3", compiled=True, cfg=4.5, steps=3),
    Prompt("compiled+swap+deepcache2", compiled=True, swap=True, deepcache=2),
    Prompt("plain", seed=8),  # right after the swap: the original checkpoint's weights, as loaded
)
# Three passes over the configurations; the plain prompt always right after the swap. The first compiles (in the
# background child), the second may load the child's graphs, the third finds everything in place.
PASSES = ((0, 1, 2, 3, 4), (0, 3, 4, 2, 1), (0, 3, 4, 2, 1))
# The references' servers: every prompt eager (the pack's switch), whatever nodes it has.
EAGER = {"ACCEL_DISABLE_COMPILE": "1"}


def graph_of(prompt: Prompt, prefix: str) -> dict:
    model = ["1", 0]
    if prompt.model == "sd3":
        case = BY_FAMILY["sd3"]
        graph = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": case.file_name, "weight_dtype": "default"}},
                 "5": {"class_type": "AccelTestInputs", "inputs": {"family": "sd3", "seed": prompt.seed,
                                                                    "tokens": case.tokens}}}
        positive, negative, latent = ["5", 0], ["5", 1], ["5", 2]
    else:
        graph = {
            "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "accel-sd15-small.safetensors",
                                                         "weight_dtype": "default"}},
            "4": {"class_type": "CLIPLoader", "inputs": {"clip_name": "accel-clip-l.safetensors",
                                                         "type": "stable_diffusion"}},
            "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 0], "text": "a lighthouse at dawn"}},
            "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 0], "text": "blurry"}},
            "7": {"class_type": "EmptyLatentImage", "inputs": {"width": prompt.size, "height": prompt.size,
                                                               "batch_size": prompt.batch}},
        }
        positive, negative, latent = ["5", 0], ["6", 0], ["7", 0]
    if prompt.lora:
        graph["20"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
            "model": model, "lora_name": "accel-sd15-lora.safetensors", "strength_model": prompt.lora}}
        model = ["20", 0]
    if prompt.compiled:
        graph["21"] = {"class_type": "AccelCompileModel", "inputs": {
            "model": model, "mode": "default", "dynamic": prompt.dynamic, "scope": "auto", "choose": prompt.choose,
            "background": prompt.background}}
        model = ["21", 0]
    if prompt.swap:
        graph["22"] = {"class_type": "AccelSwapWeights", "inputs": {
            "model": model, "weights_file": "accel-sd15-small-b.safetensors"}}
        model = ["22", 0]
    if prompt.deepcache:
        graph["23"] = {"class_type": "AccelDeepCache", "inputs": {
            "model": model, "cache_interval": prompt.deepcache, "cache_depth": 0, "start_percent": 0.0,
            "end_percent": 1.0, "schedule": "uniform"}}
        model = ["23", 0]
    common = {"model": model, "steps": prompt.steps, "cfg": prompt.cfg, "sampler_name": "euler",
              "scheduler": "normal", "positive": positive, "negative": negative, "latent_image": latent}
    if prompt.advanced:
        graph["8"] = {"class_type": "KSamplerAdvanced", "inputs": {
            **common, "add_noise": "enable", "noise_seed": prompt.seed, "start_at_step": 0, "end_at_step": 10000,
            "return_with_leftover_noise": "disable"}}
    else:
        graph["8"] = {"class_type": "KSampler", "inputs": {**common, "seed": prompt.seed, "denoise": 1.0}}
    graph["9"] = {"class_type": "SaveLatent", "inputs": {"samples": ["8", 0], "filename_prefix": prefix}}
    return graph


def run_latent(server, prompt: Prompt, prefix: str) -> torch.Tensor:
    return latent_of(server, graph_of(prompt, prefix), prefix)


def latent_of(server, graph: dict, prefix: str) -> torch.Tensor:
    """Run an API graph whose SaveLatent writes under `prefix`, and read that latent back."""
    server.run_workflow(graph, timeout=900)
    return saved_latent(server, prefix)


def saved_latent(server, prefix: str) -> torch.Tensor:
    """The one latent a finished prompt's SaveLatent wrote under `prefix`."""
    from safetensors.torch import load_file

    files = sorted((server.base_dir / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, files
    return load_file(str(files[0]))["latent_tensor"].float()


def server_of(base: Path, env: dict | None = None, api_nodes: bool = False) -> ComfyServer:
    """A server with the test-only conditioning node and a compile cache of its own (unless `env` names one);
    without ComfyUI's API nodes unless `api_nodes` (the benchmarks' servers have them: their published tables
    were measured so, and bench/fleet_cache.py times each server's start)."""
    return ComfyServer(base, extra_nodes=(TEST_NODES,), api_nodes=api_nodes,
                       env={"ACCEL_CACHE_DIR": str(base / "compile-cache"), **(env or {})})


def rss_mb(server) -> float:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def cold_compiles(server) -> dict[str, int]:
    """Per kind, the graphs compiled from scratch (torch's FX graph cache missed); a graph the background child
    compiled and this process loads is a hit."""
    return {k["kind"]: k["disk_cache"].get("fx_graph_misses", 0)
            for k in server.get_json("/accel/stats")["compile"]["kinds"]}
