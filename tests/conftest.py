"""Fixtures: a real ComfyUI imported in-process, the pack loaded by ComfyUI's own loader, and a real server.

ComfyUI is `$COMFYUI_DIR` when set, else the default 0.3.75 from `make setup`. Nothing here mocks
ComfyUI or torch.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

# Graphs compiled in a test's own process (choose="always compiled", most of the suite's compiles) would each be
# saved whole by a background child afterwards, as a user's ComfyUI saves them (ACCEL_SAVE_COMPILES, on by default):
# dozens of children re-tracing beside the next tests on 2 cores. The suite leaves the save to the tests of it
# (test_compile_cache.py's, which turn it on for their processes); its processes and servers inherit this.
os.environ.setdefault("ACCEL_SAVE_COMPILES", "0")

# Two test processes share this machine's cores (pyproject's `-n 2`): most of the suite is single-threaded
# (Dynamo, inductor's code generation, the C compiler, imports), so two of them fill the cores, and torch's own
# threads stay one per process so the two never oversubscribe the cores. Every process a test starts (servers,
# probes, background children) inherits the setting, so outputs compared across processes were computed with
# the same thread count (a CPU kernel split over 2 threads may round differently than over 1). torch may be
# imported already (by a plugin), so its count is set too.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
# Appended, not prepended: ComfyUI's top-level `nodes` module must win over this pack's `nodes/` folder.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from tools.comfy_env import comfyui_version, import_comfyui, load_pack  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def compiler_cache(tmp_path_factory):
    """A compiler cache, as ccache is in CI (tools/cxx_cache.py): a `g++` first on PATH for this process and every
    process the tests start. Each test whose compile cache starts empty builds the same C++ again (inductor's
    checks of the CPU in each new process, the kernels of the shared models), and so does every run of the suite;
    a build done once is copied, byte for byte what g++ wrote. torch's own caches, which the tests count, are not
    touched. The builds are kept between runs in the user's cache folder (`persistent_cxx_folder`), as ccache keeps
    its own: a second `make test` on a machine compiles no kernel the first one compiled, from any clone of the
    project (CI's fresh clone included). ACCEL_TEST_CXX_CACHE=run keeps them for this run only (what a fresh
    machine sees), =0 turns the cache off (so does a machine without g++). Either way the run's folder gets
    `cxx-calls.log`: a line per cached call, hit or miss with its seconds, what it built, and its test."""
    real = shutil.which("g++")
    choice = os.environ.get("ACCEL_TEST_CXX_CACHE")
    if choice == "0" or real is None:
        yield None
        return
    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = None if choice == "run" else persistent_cxx_folder(real)
    folder = folder or run_dir / "cxx-cache"
    launcher = run_dir / "cxx-bin" / "g++"
    for made in (folder, launcher.parent):
        made.mkdir(parents=True, exist_ok=True)
    text = f'#!/bin/sh\nexec "{sys.executable}" -S "{ROOT / "tools" / "cxx_cache.py"}" "$@"\n'
    tmp = launcher.with_name(f"g++.{os.getpid()}")  # both test processes write it: whole, through a rename
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(launcher)
    names = ("ACCEL_TEST_CXX_CACHE", "ACCEL_TEST_CXX_LOG", "ACCEL_TEST_REAL_CXX", "ACCEL_TEST_TORCH_DIR", "PATH")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(ACCEL_TEST_CXX_CACHE=str(folder), ACCEL_TEST_CXX_LOG=str(run_dir / "cxx-calls.log"),
                      ACCEL_TEST_REAL_CXX=str(Path(real).resolve()), ACCEL_TEST_TORCH_DIR=_torch_dir(),
                      PATH=f"{launcher.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    yield folder
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's start and end, and its test process, in the run's `test-times.log` beside `cxx-calls.log`: a build
    made by a long-lived process (a background compile worker, a module's server) is told to the test that ran in
    that test process at that time."""
    start, calls_log = time.time(), os.environ.get("ACCEL_TEST_CXX_LOG")  # the last test's teardown unsets it
    yield
    calls_log = calls_log or os.environ.get("ACCEL_TEST_CXX_LOG")  # the first test's setup sets it
    if calls_log:
        with open(Path(calls_log).with_name("test-times.log"), "a") as out:
            out.write(f"{start:.1f} {time.time():.1f} {os.environ.get('PYTEST_XDIST_WORKER', '-')} {item.nodeid}\n")


# A kept build not used for this long is deleted when a run starts (a hit refreshes its time).
CXX_KEEP_DAYS = 14


def persistent_cxx_folder(real: str) -> Path | None:
    """The builds kept between runs, in the user's cache folder (`$XDG_CACHE_HOME`, else `~/.cache`), as ccache
    keeps its own, so that every clone of the project on a machine shares them: a fresh clone's `make test`, CI's
    among them, builds no kernel an earlier run built. Else in the test environment where that folder cannot be
    written (`make clean` then removes them with it); None where neither can. One folder per compiler, torch build
    and CPU: a kernel's source names torch's headers without holding them, so the same source may build differently
    under another torch or compiler, and inductor builds with -march=native, for this CPU's instructions only (a
    folder copied to another machine must not load them there). torch is named by its release and source commit,
    not its folder: each clone installs the same wheel into its own environment, and tools/cxx_cache.py leaves that
    folder out of the command line it looks builds up by."""
    import hashlib
    import platform

    import torch

    compiler = Path(real).resolve()
    info = compiler.stat()
    identity = (f"{compiler}|{info.st_size}|{info.st_mtime_ns}|{torch.__version__}|{torch.version.git_version}|"
                f"{platform.machine()}|{_cpu_description()}")
    name = hashlib.sha256(identity.encode()).hexdigest()[:16]
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for root in (user_cache / "comfyui-accel-test-cxx", Path(sys.prefix) / "accel-test-cxx-cache"):
        folder = root / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        break
    else:
        return None
    stale = time.time() - CXX_KEEP_DAYS * 86400
    for path in folder.iterdir():
        try:
            if path.stat().st_mtime < stale:
                path.unlink()
        except OSError:
            pass  # the other test process pruned it first
    return folder


# Inductor's check of the CPU's vector instruction sets, once for the run (tests/vec_isa_once.py): decided here,
# in the run's first process, before the test processes start, so that they and every process they start inherit
# it. The verdict is kept with the compiler cache's kept builds, whose folder names the same compiler, torch and
# CPU.
def _decide_vec_isa() -> str:
    import vec_isa_once

    def kept_folder() -> Path | None:
        real = shutil.which("g++")
        return persistent_cxx_folder(real) if real and os.environ.get("ACCEL_TEST_CXX_CACHE") not in ("0", "run") \
            else None

    return vec_isa_once.decide(kept_folder)


def _torch_dir() -> str:
    """torch's folder in this environment, which tools/cxx_cache.py leaves out of a build's key: as inductor names
    it in a build's command line (an absolute path, links not resolved)."""
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def _cpu_description() -> str:
    """The CPU's model and instruction flags as Linux lists them (the first core's), or "" elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "|".join(next((line for line in text.splitlines() if line.startswith(name)), "") for name in wanted)


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory):
    """Hermetic tests: every test process, and every process a test starts (servers, probes, background
    children inherit the environment), uses a compile cache of this test run, never the ComfyUI's own
    `accel_cache/` nor a user's ACCEL_CACHE_DIR. The two test processes share it, as they shared the ComfyUI's
    before (a kind one compiled, the other loads). The ComfyUI's own cache is left as it was: checked at the end
    (its files, sizes and times)."""
    from tools.comfy_env import comfyui_dir

    base = tmp_path_factory.getbasetemp()
    run_dir = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's, above each process's
    own = comfyui_dir() / "accel_cache"
    before = _tree(own)
    previous = os.environ.get("ACCEL_CACHE_DIR")
    os.environ["ACCEL_CACHE_DIR"] = str(run_dir / "accel-compile-cache")
    yield Path(os.environ["ACCEL_CACHE_DIR"])
    if previous is None:
        os.environ.pop("ACCEL_CACHE_DIR", None)
    else:
        os.environ["ACCEL_CACHE_DIR"] = previous
    assert _tree(own) == before, f"the tests changed the ComfyUI's own compile cache {own}"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    if not root.is_dir():
        return {}
    found = {}
    for path in root.rglob("*"):
        try:
            info = path.lstat()
        except OSError:
            continue
        found[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return found


# CI's two test processes each take whole files (pyproject: --dist loadfile, --no-loadscope-reorder), in the order
# collected: the longest files go first (the seconds of `make test`'s tests per file, measured on ComfyUI 0.33.0
# on the 2-core test machine, 2026-12-02, longest first), so neither process ends on a long file while the other
# idles. Files not named follow.
LONGEST_FIRST = ("test_compile_model.py", "test_compile_video_families.py", "test_compile_families.py",
                 "test_web_ui.py", "test_compile_cache.py", "test_templates.py", "test_weight_formats.py",
                 "test_deepcache_dit.py", "test_compile_flux.py", "test_core_patches.py", "test_remote_cache.py",
                 "test_deepcache.py", "test_swap_weights.py", "test_conditioning_dit.py", "test_cache_faults.py",
                 "test_process_tax.py", "test_auto_mode_fair.py", "test_conditioning.py", "test_doctor.py",
                 "test_faults.py", "test_bench_gpu.py", "test_server_families.py", "test_server_e2e.py")

# The full tier: `make test` runs each ComfyUI's suite in at most 18 minutes on the 2-core test machine (CI runs
# it on two ComfyUI releases), so its longest tests, each a scenario `make test` covers in a shorter form, run only
# under `make test-full` (ACCEL_TEST_FULL=1). Such a test carries `@pytest.mark.full(why=...)`, its reason naming
# the test that covers it in `make test`; without the switch it is skipped with that reason, by name.
FULL_SWITCH = "ACCEL_TEST_FULL"


def full_tier() -> bool:
    return os.environ.get(FULL_SWITCH, "").strip().lower() not in ("", "0", "false", "no", "off")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    if full_tier():
        return
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None:
            why = mark.kwargs.get("why")
            assert why, f"{item.nodeid}: @pytest.mark.full needs why=... (what covers it in make test)"
            item.add_marker(pytest.mark.skip(reason=f"full tier (make test-full, {FULL_SWITCH}=1): {why}"))


VEC_ISA = _decide_vec_isa()


def pytest_report_header(config):
    from tools.comfy_env import comfyui_dir

    path = comfyui_dir()
    import torch

    return [f"ComfyUI {comfyui_version(path)} at {path}; torch {torch.__version__}", f"CPU checks: {VEC_ISA}"]


@pytest.fixture(scope="session")
def comfy_dir() -> Path:
    """ComfyUI's core imported in this process (CPU), as its main.py would."""
    return import_comfyui(cpu=True)


@pytest.fixture(scope="session")
def comfy_nodes(comfy_dir):
    """ComfyUI's own node classes (UNETLoader, LoraLoader, KSampler, ...)."""
    import nodes

    return nodes


@pytest.fixture(scope="session")
def accel_pack(comfy_dir):
    """The pack as ComfyUI loads it from custom_nodes (its module, with `accel` and `nodes` below it)."""
    return load_pack()


@pytest.fixture(scope="session")
def engine(accel_pack):
    """The pack's Compile Model engine (accel/compile) as ComfyUI loaded it."""
    return accel_pack.accel.compile


@pytest.fixture(scope="session")
def comfy_server(tmp_path_factory):
    """A started ComfyUI server (main.py --cpu) with this pack in its custom_nodes; stopped even on failure."""
    with ComfyServer(tmp_path_factory.mktemp("comfy-server"), api_nodes=False) as server:
        yield server
