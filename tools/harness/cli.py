"""The benchmarks' command lines: one parser with the options they share."""
from __future__ import annotations

import argparse

SHARED = {  # option: (type, help)
    "model": (str, "the model's file in ComfyUI's diffusion_models folder"),
    "steps": (int, "sampling steps"),
    "latent": (int, "latent height and width (image side / 8)"),
    "rounds": (int, "rounds, each timing every variant once, in turn (medians)"),
    "variants": (str, "comma-separated, each in a fresh process"),
}


def parser(doc: str, child: bool = False, **defaults) -> argparse.ArgumentParser:
    """A benchmark's parser: described by the first line of its `doc`; each of SHARED named in `defaults` added
    with that default; with `child`, the hidden `--child VARIANT` by which the script runs one variant in a
    fresh process of its own (tools/harness/child.py)."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        kind, help_text = SHARED[name]
        out.add_argument(f"--{name}", type=kind, default=default, help=help_text)
    if child:
        out.add_argument("--child", help=argparse.SUPPRESS)
    return out
