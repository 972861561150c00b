"""Command line of the pack's engine, run from the pack's directory (custom_nodes/comfyui-accel):

    python -m accel precompile --model FILE --sizes 512x512,768x1024 --batch 1,2
    python -m accel cache info
    python -m accel cache export FILE      # one file: copy it into an image, or to another machine
    python -m accel cache import FILE      # same GPU and torch: what does not match is skipped, with the reason
    python -m accel cache clear
    python -m accel cache clear --remote   # this environment's entries in the store ACCEL_REMOTE_CACHE names
    python -m accel doctor [--pid N] [--json]  # threads, OpenMP runtimes, affinity, malloc: this process or pid N

ComfyUI is found from --comfyui, else $COMFYUI_DIR, else the ComfyUI this pack is installed in. The cache is
the one the nodes use: $ACCEL_CACHE_DIR, else accel_cache/ in ComfyUI's directory. With ACCEL_REMOTE_CACHE (and
ACCEL_REMOTE_CACHE_KEY) set, precompile publishes to that store too, and `cache info` shows what it holds for
this machine's environment.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .comfy_import import is_base_directory  # imports neither torch nor ComfyUI: the help stays instant

PACK_DIR = Path(__file__).resolve().parent.parent
EXAMPLES = """examples (run from ComfyUI/custom_nodes/comfyui-accel with ComfyUI's Python):
  python -m accel precompile --model v1-5-pruned-emaonly-fp16.safetensors --sizes 512x512,768x1024 --batch 1,2
  python -m accel cache info            where the compile cache is, what it holds
  python -m accel cache clear           empty it (the Accel panel in the web UI has the same button)
  python -m accel cache export FILE     one file: copy it into an image or to a machine with the same GPU and torch
  python -m accel doctor                threads, OpenMP runtimes and malloc settings, when steps run slower than
                                        expected

The compile cache is $ACCEL_CACHE_DIR, else accel_cache/ in ComfyUI's directory."""


def default_comfyui() -> Path:
    if os.environ.get("COMFYUI_DIR"):
        return Path(os.environ["COMFYUI_DIR"]).expanduser()
    # installed as ComfyUI/custom_nodes/<pack>; a symlinked pack resolves elsewhere, the shell's $PWD does not
    candidates = [PACK_DIR.parent.parent, Path(os.environ.get("PWD", ".")).parent.parent]
    return next((c for c in candidates if (c / "main.py").is_file()),
                next((c for c in candidates if is_base_directory(c)), candidates[0]))


def parser() -> argparse.ArgumentParser:
    from .compile.options import DYNAMIC, MODES, SCOPES

    top = argparse.ArgumentParser(prog="python -m accel", description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    comfyui_help = "ComfyUI directory (default: $COMFYUI_DIR, else the ComfyUI this pack is installed in)"
    top.add_argument("--comfyui", type=Path, default=None, help=comfyui_help)
    # metavar: the usage and the list name only what a user runs (compile-worker is internal, see below)
    commands = top.add_subparsers(dest="command", required=True, metavar="{precompile,cache,doctor}")
    pre = commands.add_parser("precompile", help="warm the compile cache for chosen sizes", allow_abbrev=False)
    pre.add_argument("--model", required=True, help="a path, or a file name in diffusion_models/ or checkpoints/")
    pre.add_argument("--sizes", default="512x512", help="image sizes WIDTHxHEIGHT, comma-separated")
    pre.add_argument("--batch", default="1", help="image batch sizes, comma-separated")
    pre.add_argument("--cfg", type=float, default=7.0, help="above 1, cond and uncond run as one batch (as KSampler)")
    pre.add_argument("--mode", choices=MODES, default="default", help="as on the Compile Model node")
    pre.add_argument("--dynamic", choices=DYNAMIC, default="auto", help="as on the Compile Model node")
    pre.add_argument("--scope", choices=SCOPES, default="auto", help="as on the Compile Model node")
    pre.add_argument("--cpu", action="store_true", help="compile for the CPU (default when there is no GPU)")
    pre.add_argument("--comfyui-args", default="", metavar="FLAGS",
                     help="your ComfyUI server's flags, as on its command line, after an = "
                          "(--comfyui-args=\"--fast --highvram\"): its blocks load the graphs precompile saves "
                          "only where the flags that change what they compute are the same")
    # Compile Model's background compiler; no help= keeps it out of the list (help=SUPPRESS showed "==SUPPRESS==")
    worker = commands.add_parser("compile-worker")
    worker.add_argument("directory", type=Path)
    cache = commands.add_parser("cache", help="inspect, export, import or clear the compile cache", allow_abbrev=False)
    # --comfyui after the command too (before, argparse took it there for an abbreviation of --comfyui-args);
    # SUPPRESS: absent there, it leaves the value given before the command
    for command in (pre, cache):
        command.add_argument("--comfyui", type=Path, default=argparse.SUPPRESS, help=comfyui_help)
    cache.add_argument("action", choices=("info", "export", "import", "clear"))
    cache.add_argument("file", nargs="?", type=Path, help="the file to export to or import from")
    cache.add_argument("--remote", action="store_true",
                       help="clear: remove this environment's entries from the remote store instead of the directory")
    doctor = commands.add_parser("doctor", help="thread, OpenMP and malloc diagnostics of this machine and process")
    doctor.add_argument("--pid", type=int, default=None,
                        help="inspect another process (a running ComfyUI server) instead; it has no torch section")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--seconds", type=float, default=1.0, help="how long to sample the busiest threads")
    return top


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as err:  # bad input (PrecompileError is one): the message says what to do
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file or folder the command could not read or write (permissions, a full disk)
        where = f" {err.filename}" if err.filename else ""
        print(f"error: cannot use{where}: {err.strerror or err}. Check that path, its permissions and the free space "
              "there (ACCEL_CACHE_DIR sets the compile cache's folder); a file written before the error stays.",
              file=sys.stderr)
        return 2


def run(args) -> int:
    if args.command == "compile-worker":  # started by a ComfyUI process (accel/compile/background/)
        from .compile.child.serve import serve

        return serve(args.directory)
    if args.command == "doctor":  # needs no ComfyUI: it runs before the ComfyUI directory is looked for
        return doctor(args.pid, args.json, args.seconds)
    from .precompile import PrecompileError, import_comfyui

    comfy_dir = (args.comfyui or default_comfyui()).resolve()
    if args.command == "precompile":
        import torch

        from .compile import CompileOptions
        from .precompile import parse_batches, parse_sizes, precompile

        sizes, batches = parse_sizes(args.sizes), parse_batches(args.batch)
        options = CompileOptions(mode=args.mode, dynamic=args.dynamic, scope=args.scope, choose="always compiled")
        import_comfyui(comfy_dir, args.cpu or not torch.cuda.is_available(), args.comfyui_args)
        print(json.dumps(precompile(args.model, sizes, batches, options, args.cfg), indent=1))
        return 0

    from .cache import CacheBusy, cache_root, clear_disk_cache, disk_info, export_cache, import_cache
    from .cache.location import DIR_NAME, ENV_VAR

    if not os.environ.get(ENV_VAR) and not ((comfy_dir / "main.py").is_file() or is_base_directory(comfy_dir)):
        raise PrecompileError(f"no ComfyUI at {comfy_dir}, so no cache to use: run this from the pack's folder in "
                              f"ComfyUI/custom_nodes, or pass --comfyui DIR (ComfyUI's folder, or its "
                              f"--base-directory), or set {ENV_VAR}")
    root = cache_root() if os.environ.get(ENV_VAR) else comfy_dir / DIR_NAME
    if args.action in ("export", "import") and args.file is None:
        raise PrecompileError(f"cache {args.action} needs a FILE argument")
    if args.action == "info":
        print(json.dumps({**disk_info(root), "remote": remote_info()}, indent=1))
    elif args.action == "export":
        if not root.is_dir():
            raise PrecompileError(f"there is no compile cache at {root} yet; run a workflow or precompile first")
        manifest = export_cache(root, args.file)
        count = sum(len(env["files"]) for env in manifest["environments"])
        print(f"exported {count} files of {len(manifest['environments'])} environments to {args.file}")
    elif args.action == "import":
        import torch

        device_types = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
        for line in import_cache(root, args.file, device_types):
            print(line)
    elif args.action == "clear" and args.remote:
        for line in clear_remote():
            print(line)
    elif args.action == "clear":
        # the pack's environment folders only: ACCEL_CACHE_DIR may name a folder that holds other things
        try:
            cleared = clear_disk_cache(root)
        except CacheBusy as err:
            raise PrecompileError(f"the compile cache is busy ({err}); try again when it is done") from None
        left = " (its other files stay)" if root.exists() else ""
        print(f"removed {cleared['removed_megabytes']} MB of compiled graphs from {root}{left}")
    return 0


def doctor(pid: int | None, as_json: bool, seconds: float) -> int:
    from .diagnostics import busy_threads, doctor_report

    if pid is not None and not Path(f"/proc/{pid}").is_dir():
        raise ValueError(f"no process {pid} to inspect (or no /proc: the doctor reads Linux's)")
    report = doctor_report(pid)
    report["busy_threads"] = busy_threads(seconds, pid)
    if as_json:
        print(json.dumps(report, indent=1))
        return 0
    affinity = report["affinity"]
    print(f"process {report['pid']}: {report['threads']} threads; may run on CPUs {affinity['allowed_cpus']} "
          f"of {affinity['cpu_count']}")
    print(f"OpenMP runtimes: {', '.join(report['openmp_runtimes']) or 'none loaded'}")
    torch_info = report["torch"]
    if torch_info is None:
        print("torch: not shown for another process (its thread counts can only be asked from inside it)")
    else:
        print(f"torch {torch_info['version']}: {torch_info['num_threads']} threads, "
              f"{torch_info['num_interop_threads']} inter-op threads, "
              f"{torch_info['num_threads_in_new_thread']} threads as a new thread sees it")
        for line in torch_info["parallel_info"]:
            print(f"  {line}")
    print("environment: " + (", ".join(f"{k}={v}" for k, v in report["environment"].items()) or "no thread settings"))
    print(f"busiest threads over {seconds:g} s (share of one core):")
    for thread in report["busy_threads"][:8] or [{"tid": "-", "name": "(none used the CPU)", "core_share": 0}]:
        print(f"  {thread['tid']:>8}  {thread['core_share']:6.2f}  {thread['name']}")
    print_malloc(report["malloc"])
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    if not report["warnings"]:
        print("no known thread or malloc problem found")
    return 0


def print_malloc(found: dict) -> None:
    allocator = found["allocator"]
    other = allocator["preloaded"] + [p for p in allocator["mapped"] if p not in allocator["preloaded"]]
    if other or allocator["malloc_is_glibcs"] is False:
        print(f"malloc: served by {', '.join(other) or 'another allocator than glibc'} (glibc's settings unused)")
    else:
        print(f"malloc: glibc {found['glibc']}" if found["glibc"] else "malloc: not glibc's (settings unknown)")
    mp = found["params"]
    if mp is None:
        print("  live settings: not readable from another process (GET /accel/stats of a running ComfyUI shows them)")
    elif not mp:
        print("  live settings: unknown (glibc's parameters could not be read and checked against mallinfo2)")
    else:
        print(f"  mmap threshold {mp['mmap_threshold']}, trim threshold {mp['trim_threshold']}, top pad "
              f"{mp['top_pad']} bytes; " + ("dynamic (glibc moves them itself)" if mp["dynamic"]
                                            else "frozen (a mallopt or MALLOC_*_ variable set them)"))
    if found["tune"]:
        from .malloc.tune import reason_not_to_tune

        tune, why_not = found["tune"], found["tune"]["why_not"] or reason_not_to_tune()
        print(f"  {tune['switch']}: " + ("applied" if tune["applied"] else f"off here ({why_not})" if why_not
                                          else "would be applied when Compile Model is first applied"))
    print("  environment: " + (", ".join(f"{k}={v}" for k, v in found["environment"].items()) or "no malloc settings"))
    print("  libraries importing mallopt or malloc_trim: "
          + (", ".join(f"{p} ({', '.join(n)})" for p, n in found["importers"].items()) or "none mapped"))


def this_machines_environments() -> list[str]:
    """The environment ids this machine compiles for: its GPU's, if it has one, and its CPU's."""
    import torch

    from .cache.location import environment_id, fingerprint

    device_types = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    return [environment_id(fingerprint(device_type)) for device_type in device_types]


def _store():
    from .cache.remote import KEY_ENV, URL_ENV, remote_store
    from .precompile import PrecompileError

    store = remote_store()
    if store is None:
        raise PrecompileError(f"no usable remote store: set {URL_ENV} (redis://host:port/db) and {KEY_ENV} (the "
                              "fleet's shared secret); a warning above says what was wrong, if one was set")
    return store


def remote_info() -> list[dict] | None:
    from .cache.remote import URL_ENV

    if not os.environ.get(URL_ENV):
        return None
    store = _store()
    return [store.info(env_id) for env_id in this_machines_environments()]


def clear_remote() -> list[str]:
    from .precompile import PrecompileError

    store = _store()
    lines = []
    for env_id in this_machines_environments():
        removed = store.clear(env_id)
        if removed < 0:
            raise PrecompileError(f"the remote store {store.url} failed: {store.describe()['problem']}")
        lines.append(f"removed {removed} entries of environment {env_id} from {store.url}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
