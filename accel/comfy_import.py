"""Import ComfyUI's core into a process of the pack's own (precompile, the dev tools, tests, benchmarks).

ComfyUI reads its command-line flags when `comfy.model_management` is first imported, and its main.py imports
`utils.extra_config` before `nodes` puts ComfyUI/comfy/ at the front of sys.path (after which `utils` would
resolve to comfy/utils.py). This repeats those steps in that order, and nothing else. Never used inside a
running ComfyUI, which has imported itself.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path


def is_base_directory(folder: Path) -> bool:
    """A ComfyUI started with --base-directory FOLDER (ComfyUI Desktop's user folder, a server's data volume): its
    custom_nodes/ and models/ are there, ComfyUI's code elsewhere. The nodes' compile cache is in it."""
    return not (folder / "main.py").is_file() and (folder / "custom_nodes").is_dir()


def import_comfyui_core(comfy_dir: Path, cpu: bool, **flags) -> None:
    """`cpu` and any other `flags` (ComfyUI's own argument names, e.g. use_pytorch_cross_attention=True) are set
    on ComfyUI's parsed args first; they take effect only if ComfyUI's core was not imported yet."""
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    import comfy.options  # noqa: F401  (ComfyUI parses an empty argv when imported, not this process's)
    from comfy.cli_args import args

    if "comfy.model_management" not in sys.modules:
        args.cpu = cpu
        for name, value in flags.items():
            if not hasattr(args, name):
                raise ValueError(f"ComfyUI at {comfy_dir} has no command-line flag {name!r}")
            setattr(args, name, value)
    import utils.extra_config  # noqa: F401
    import comfy.model_management  # noqa: F401


def parse_comfyui_flags(comfy_dir: Path, text: str) -> dict:
    """The flags ComfyUI's own parser reads from `text` (as on main.py's command line), those it sets away from
    their defaults, by argument name: for import_comfyui_core. ValueError, naming the flag, when ComfyUI has no
    such flag or refuses its value."""
    if not text.strip():
        return {}
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    import comfy.options  # noqa: F401  (as above: importing the parser must not parse this process's argv)
    from comfy.cli_args import parser

    try:
        parsed, unknown = parser.parse_known_args(shlex.split(text))
    except (SystemExit, ValueError) as err:  # argparse exits on a bad value, after printing why
        raise ValueError(f"ComfyUI refused the flags {text!r} (its message is above); write them as for "
                         f"ComfyUI's main.py") from err
    if unknown:
        raise ValueError(f"ComfyUI at {comfy_dir} has no flag {' '.join(unknown)}; `python main.py --help` in "
                         f"ComfyUI's folder lists them")
    return as_comfyui_sets_them({name: value for name, value in vars(parsed).items()
                                 if value != parser.get_default(name)})


def as_comfyui_sets_them(flags: dict) -> dict:
    """Parsed `flags` as comfy/cli_args.py sets them after parsing, which a server's args hold (and a saved graph's
    context digests): --fast alone is every PerformanceFeature, --fast with a list is a set of them, --force-fp16
    sets fp16_unet too. As parsed, precompile's identity had `"fast": []` where the server's had every feature,
    so nothing it saved served a server started with --fast."""
    from comfy.cli_args import PerformanceFeature

    if "fast" in flags:
        flags["fast"] = set(PerformanceFeature) if flags["fast"] == [] else set(flags["fast"])
    if flags.get("force_fp16"):
        flags["fp16_unet"] = True
    return flags
