"""Run in a fresh process by test_pack_import.py: load the pack through ComfyUI and report what changed.

    python tests/hygiene_probe.py lazy     # which heavy torch modules the pack's import pulled in, and its time
    python tests/hygiene_probe.py globals  # torch/inductor config, torch/transformers/ComfyUI attributes before/after

Prints one JSON line. A fresh process is needed because both checks are about first imports.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from tools.comfy_env import PACK_LINK_NAME, import_comfyui  # noqa: E402

HEAVY_MODULES = ["torch._dynamo", "torch._inductor", "torch._inductor.config", "torch.compiler._cache"]
# Modules and classes whose attributes must stay the very same objects: a pack must never monkeypatch them.
WATCHED = [
    "torch", "torch.nn", "torch.nn.functional", "torch.compiler", "torch._dynamo", "torch.backends.cuda",
    "transformers", "transformers.modeling_utils",
    "nodes", "folder_paths", "execution", "comfy.model_management", "comfy.model_patcher", "comfy.patcher_extension",
    "comfy.samplers", "comfy.sample", "comfy.ops", "comfy.model_base", "comfy.sd", "comfy.lora",
    "comfy.ldm.modules.attention", "comfy.ldm.modules.diffusionmodules.openaimodel",
]
WATCHED_CLASSES = [("torch", "Tensor"), ("torch.nn", "Module"), ("comfy.model_patcher", "ModelPatcher"),
                   ("comfy.model_base", "BaseModel"), ("comfy.samplers", "KSampler"), ("comfy.samplers", "CFGGuider")]


def load_pack(comfy_dir: Path) -> float:
    import nodes

    link = comfy_dir / "custom_nodes" / PACK_LINK_NAME
    path = link if link.exists() and link.resolve() == ROOT else ROOT
    start = time.perf_counter()
    if not asyncio.run(nodes.load_custom_node(str(path))):
        raise SystemExit("ComfyUI failed to load the pack")
    seconds = time.perf_counter() - start
    # Touch every node's schema too: that is what ComfyUI's /object_info does after loading.
    for cls in nodes.NODE_CLASS_MAPPINGS.values():
        if cls.__module__.startswith(str(path).replace(".", "_x_")):
            cls.INPUT_TYPES()
    return seconds


def config_snapshot() -> dict:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    torch = sys.modules["torch"]
    return {
        "dynamo": {k: repr(v) for k, v in dynamo_config.get_config_copy().items()},
        "inductor": {k: repr(v) for k, v in inductor_config.get_config_copy().items()},
        "torch_version": torch.__version__,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "grad_enabled": torch.is_grad_enabled(),
    }


def attribute_snapshot() -> dict:
    """id() of every attribute of the watched modules and classes. Submodules are left out: importing one
    adds it to its package, which is not a patch."""
    modules = [importlib.import_module(name) for name in WATCHED]  # all imports first, then the snapshot
    snap = {}
    for name, module in zip(WATCHED, modules):
        snap[name] = {k: id(v) for k, v in vars(module).items()
                      if not k.startswith("__") and not isinstance(v, types.ModuleType)}
    for module_name, cls_name in WATCHED_CLASSES:
        cls = getattr(importlib.import_module(module_name), cls_name)
        snap[f"{module_name}.{cls_name}"] = {k: id(v) for k, v in vars(cls).items()}
    return snap


def diff(before: dict, after: dict) -> list[str]:
    changes = []
    for group in before:
        if isinstance(before[group], dict):
            for key in set(before[group]) | set(after[group]):
                if before[group].get(key) != after[group].get(key):
                    changes.append(f"{group}.{key}")
        elif before[group] != after[group]:
            changes.append(group)
    return sorted(changes)


def import_like_comfyui_main() -> Path:
    """ComfyUI's main.py imports these before it loads any custom node; what they import is not the pack's doing."""
    comfy_dir = import_comfyui(cpu=True)
    for name in ("execution", "server", "nodes"):
        importlib.import_module(name)
    return comfy_dir


def main(mode: str) -> None:
    comfy_dir = import_like_comfyui_main()
    if mode == "lazy":
        before = {m for m in HEAVY_MODULES if m in sys.modules}
        seconds = load_pack(comfy_dir)
        after = {m for m in HEAVY_MODULES if m in sys.modules}
        print(json.dumps({"already_imported": sorted(before), "newly_imported": sorted(after - before),
                          "import_seconds": seconds}))
    else:
        import transformers  # noqa: F401  (present in ComfyUI's environment; the pack must not touch it)

        config_before, attrs_before = config_snapshot(), attribute_snapshot()
        load_pack(comfy_dir)
        config_after, attrs_after = config_snapshot(), attribute_snapshot()
        print(json.dumps({"config_changes": diff(config_before, config_after),
                          "attribute_changes": diff(attrs_before, attrs_after),
                          "torch_version": config_after["torch_version"]}))


if __name__ == "__main__":
    main(sys.argv[1])
