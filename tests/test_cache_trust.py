"""The compile cache holds code (torch loads compiled kernels and unpickles graphs from it; the background child
unpickles its jobs from it), so the pack creates it owner-only and refuses, with one warning that names the
problem and the fix, a cache that another user owns, that group or others can write to, or that holds a symbolic
link. A refused cache is left exactly as it was, and compiling goes on without it (accel/cache/trust.py). The job
folders a killed ComfyUI leaves in it are swept by the next process (background/job_folders.py)."""
from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

import pytest


@pytest.fixture
def store(accel_pack):
    return sys.modules[accel_pack.__name__ + ".accel.cache.store"]


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): mode(p) for p in sorted(root.rglob("*"))}


def test_a_new_cache_is_owner_only(store, tmp_path):
    root = tmp_path / "not-yet" / "cache"
    env = store.EnvironmentCache(root, "cpu")
    assert env.check_usable(), env.problem
    for path in (tmp_path / "not-yet", root, env.dir, env.inductor_dir, env.artifacts_dir):
        assert mode(path) == 0o700, (path, oct(mode(path)))
    assert mode(env.dir / "fingerprint.json") == 0o600
    artifact = env.artifacts_dir / "somekey" / "graphs.bin"
    store.write_atomic(artifact, store.pack_artifact(b"payload", "a kind"))
    assert mode(artifact.parent) == 0o700 and mode(artifact) == 0o600


def _make_untrusted(problem: str, root: Path, env) -> None:
    if problem == "group-writable":
        os.chmod(root, 0o770)
    elif problem == "world-writable":
        os.chmod(root, 0o777)
    elif problem == "another user's":
        os.chown(root, 4321, 4321)  # the suite runs as root in CI; skipped otherwise (below)
    elif problem == "a symbolic link inside":
        elsewhere = root.parent / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        env.dir.mkdir(mode=0o700)
        env.artifacts_dir.symlink_to(elsewhere, target_is_directory=True)


@pytest.mark.parametrize("problem, said", [
    ("group-writable", "writable by group or others (mode 770)"),
    ("world-writable", "writable by group or others (mode 777)"),
    ("another user's", "is owned by uid 4321"),
    ("a symbolic link inside", "is a symbolic link"),
])
def test_an_untrusted_cache_is_refused_with_the_fix_and_left_as_it_was(store, tmp_path, caplog, problem, said):
    if problem == "another user's" and os.geteuid() != 0:
        pytest.skip("making a directory another user's needs root")
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    env = store.EnvironmentCache(root, "cpu")
    _make_untrusted(problem, root, env)
    before = listing(root)
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        assert not env.check_usable()
        assert not env.check_usable()  # checked once: one warning
        with env.compiling("somekey", "a kind"):  # a compiled call's scope: torch keeps its own cache
            assert not os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").startswith(str(root))
    assert said in env.problem, env.problem
    warnings = [r.getMessage() for r in caplog.records if "compile cache: not used" in r.getMessage()]
    assert len(warnings) == 1 and said in warnings[0] and "ACCEL_CACHE_DIR" in warnings[0], warnings
    assert listing(root) == before, "a refused cache was changed"
    assert env.describe()["writable"] is False


def test_an_artifact_others_can_write_is_not_loaded_nor_deleted(store, tmp_path, caplog):
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable(), env.problem
    artifact = env.artifacts_dir / "somekey" / "graphs.bin"
    store.write_atomic(artifact, store.pack_artifact(b"payload", "a kind"))
    os.chmod(artifact, 0o666)
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        assert env.load_file(artifact) is False
    assert artifact.exists(), "a file that may not be this user's was deleted"
    assert env.stats["artifacts_skipped_untrusted"] == 1 and env.stats["artifacts_loaded"] == 0
    assert any("writable by group or others" in r.getMessage() and str(artifact) in r.getMessage()
               for r in caplog.records), caplog.text


def test_precompiled_functions_load_only_when_they_verify(store, tmp_path, caplog):
    """Precompiled functions are code (torch unpickles them): one others can write is refused with a warning and
    left where it is; a damaged one is skipped and deleted; an intact owner-only one is handed over."""
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable(), env.problem
    meta = {"format": 1, "context": "c"}
    for name in ("a" * 20, "b" * 20, "c" * 20):
        env.save_precompiled("somekey", name, f"function {name[0]}".encode(), "a kind", {**meta, "name": name})
    folder = env.artifacts_dir / "somekey" / store.PRECOMPILED_DIR
    os.chmod(folder / f"{'a' * 20}.bin", 0o666)
    damaged = folder / f"{'b' * 20}.bin"
    damaged.write_bytes(damaged.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        found = env.precompiled_files("somekey")
    assert [payload for _, payload in found] == [b"function c"], found
    assert (folder / f"{'a' * 20}.bin").exists() and not damaged.exists()
    assert env.stats["artifacts_skipped_untrusted"] == 1 and env.stats["artifacts_skipped_corrupt"] == 1
    assert any("writable by group or others" in r.getMessage() for r in caplog.records), caplog.text


def test_job_folders_of_ended_processes_are_swept(accel_pack, tmp_path):
    """A ComfyUI killed while its background child compiled leaves the job's folder in the cache; the next
    process's first job deletes the folders of processes that are gone, and only those. A folder made before the
    live process of its pid started is an earlier process's (a container started again gives ComfyUI the same
    pid): swept too (before, kept forever)."""
    import os
    import subprocess
    import time

    folders = sys.modules[accel_pack.__name__ + ".accel.compile.background.job_folders"]
    ended = subprocess.Popen(["true"])
    ended.wait()
    jobs = tmp_path / "jobs"
    host = folders.folder_name("job").split("-")[1]
    a_day_ago = time.time_ns() - 86400 * 10**9
    names = [f"job-{host}-{ended.pid}-1", f"worker-{host}-{ended.pid}-2",  # gone: swept
             f"job-{host}-{os.getpid()}-{a_day_ago}", f"worker-{host}-1-4",  # made before their pid's process
             folders.folder_name("job"), f"worker-{host}-1-{time.time_ns()}",  # this process's, a live process's
             f"job-another.host-{ended.pid}-5", "1234-5", "notes"]  # another host's (its own pids), strangers
    for name in names:
        (jobs / name).mkdir(parents=True)
        (jobs / name / "job.pkl").write_bytes(b"")
    assert sorted(folders.sweep_stale_jobs(jobs)) == sorted(names[:4])
    assert sorted(p.name for p in jobs.iterdir()) == sorted(names[4:])


def test_a_retired_child_is_waited_for(accel_pack):
    """A background child that retires (no more jobs: its stdin closed) ends and is waited for. Before, nothing
    held it once retired, and it stayed a zombie until ComfyUI started another process (found by a review)."""
    import subprocess
    import time
    from pathlib import Path

    worker = sys.modules[accel_pack.__name__ + ".accel.compile.background.worker"]
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    worker.Worker(child, "a set-up", Path("unused")).retire()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}").exists():  # a zombie keeps its entry until it is waited for
        assert time.monotonic() < deadline, Path(f"/proc/{child.pid}/stat").read_text()
        time.sleep(0.05)


def test_a_cpu_environment_names_its_vector_instructions(accel_pack):
    """A CPU cache environment is one CPU model with one set of vector instructions: a VM's "AMD EPYC" may have
    AVX-512 or not, and C++ kernels built with it (a precompiled function's) would stop a process on a CPU without
    it with an illegal instruction. Before, the model name alone told them apart."""
    location = sys.modules[accel_pack.__name__ + ".accel.cache.location"]
    with open("/proc/cpuinfo") as info:
        flags = set(next(line for line in info if line.startswith(("flags", "Features"))).split(":", 1)[1].split())
    found = location.fingerprint("cpu")
    assert found["cpu_features"] and found["cpu_features"].split() == [
        feature for feature in location.CPU_FEATURES if feature in flags], found
    fewer = {**found, "cpu_features": " ".join(found["cpu_features"].split()[:-1])}
    assert location.environment_id(fewer) != location.environment_id(found)
