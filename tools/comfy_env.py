"""Where the ComfyUI under test lives, and how to import it in-process.

Everything (set-up, generated models, tests, demo, benchmarks) resolves ComfyUI the same way:
`$COMFYUI_DIR` when set, else the default ComfyUI 0.3.75 that `make setup` extracts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COMFYUI = ROOT / ".comfyui" / "ComfyUI"
PACK_LINK_NAME = "comfyui-accel"


def comfyui_dir() -> Path:
    env = os.environ.get("COMFYUI_DIR")
    path = Path(env).expanduser().resolve() if env else DEFAULT_COMFYUI
    if not (path / "main.py").exists():
        raise FileNotFoundError(
            f"No ComfyUI at {path} (no main.py). Run `make setup`, or set COMFYUI_DIR to a ComfyUI checkout.")
    return path


def import_comfyui(cpu: bool = True, **flags):
    """Import ComfyUI's core in this process, as ComfyUI's own main.py would, without starting a server.

    Returns the ComfyUI directory. `cpu` and any other `flags` (ComfyUI's own argument names, e.g.
    use_pytorch_cross_attention=True) are set before ComfyUI reads them (accel/comfy_import.py).
    """
    from accel.comfy_import import import_comfyui_core

    path = comfyui_dir()
    import_comfyui_core(path, cpu, **flags)
    return path


def comfyui_version(path: Path | None = None) -> str:
    path = path or comfyui_dir()
    text = (path / "comfyui_version.py").read_text()
    return text.split("__version__")[1].split('"')[1]


def pack_path(comfy_dir: Path) -> Path:
    """Where ComfyUI finds this pack: its custom_nodes link when that is this checkout, else the checkout."""
    link = comfy_dir / "custom_nodes" / PACK_LINK_NAME
    return link if link.exists() and link.resolve() == ROOT else ROOT


def load_pack(as_in_a_server: bool = False):
    """ComfyUI imported in this process, and the pack loaded by ComfyUI's own custom-node loader, as ComfyUI
    loads it from custom_nodes. Returns the pack's module (`.accel` and `.nodes` below it).

    `as_in_a_server`: the checkout's top-level `accel` package (which importing ComfyUI here went through) is made
    unimportable afterwards, as it is in a ComfyUI server, where the pack is known only by its custom_nodes name.
    A probe that loads what a child process saved (the child runs `python -m accel`, so its pickles may name
    `accel.`) must pass it: else such a file loads here and fails in every real server."""
    import asyncio

    path = str(pack_path(import_comfyui(cpu=True)))
    import nodes

    if not asyncio.run(nodes.load_custom_node(path)):
        raise RuntimeError(f"ComfyUI failed to load the pack from {path} (see the log above)")
    if as_in_a_server:
        for name in [name for name in sys.modules if name == "accel" or name.startswith("accel.")]:
            del sys.modules[name]
        sys.modules["accel"] = None  # `import accel` now raises ModuleNotFoundError, as in a server
    return sys.modules[path.replace(".", "_x_")]

