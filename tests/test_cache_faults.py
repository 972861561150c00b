"""Faults in the compile cache cost nothing but time (#16), each through real processes on a cache directory of
the test's own:

- a full disk costs persistence, not the prompt: the cache on a file system that runs out of room while a kind
  compiles. The cache's own small files still fit (the directory is usable when the process starts); torch's
  generated code and kernels do not. The probe process (tests/cache_probe.py, LTX-Video's one block kind)
  completes with the output of eager within the compiled tolerance, its kind still compiled (in torch's
  temporary cache), one warning naming the directory and the fix; once there is room again, the next process
  persists; full again, a process that loads those artifacts into torch's caches keeps them. The small file
  system is a tmpfs of its own, which needs root with CAP_SYS_ADMIN (this project's machines have both);
  elsewhere the test says so and skips;
- a damaged shares file (compile/saved_findings.py) is read as none, measured again and rewritten whole;
- a damaged environment fingerprint is said by `cache info` and the web UI's panel (whose Clear button comes with
  that answer), left out of an export, and written again at the environment's next use;
- a cache cap that is not a finite number (ACCEL_CACHE_MAX_GB=inf is no cap) never fails the size check;
- the cache commands meet a damaged file or a path they cannot use with what to do, and lose nothing; an
  environment another process's `cache clear` removed is listed again at this process's next save;
- a precompiled function file of another format (an older pack's) counts as none: the kind goes to a child, as
  one without any, rather than load through Dynamo in a prompt;
- a damaged background job (its job.pkl) fails that job alone: the child says why in the job's done file and
  takes the next one.

(Two processes compiling the same kind into one cache at once, damaged artifacts, torch's own FX graph entries
and damaged torch files: test_compile_cache.py, on its shared cache.)
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from compile_helpers import assert_close_to_eager
from probe_runs import run_probe

ROOM = 16 * 1024  # what is left free: the cache's fingerprint and the shares file fit, compiled code does not


@contextlib.contextmanager
def small_file_system(path: Path) -> Iterator[Path]:
    path.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"a small file system needs `mount -t tmpfs` (root with CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def fill(path: Path, leave: int) -> Path:
    """A file that takes all the file system's room but `leave` bytes."""
    stats = os.statvfs(path)
    filler = path / "filler"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))
    return filler


@pytest.mark.full(why=(
    "a full file system; make test compiles with an unwritable cache in "
    "test_unwritable_cache_dir_warns_once_and_the_prompt_completes"))
def test_a_full_disk_costs_persistence_not_the_prompt(accel_pack, tmp_path):
    with small_file_system(tmp_path / "volume") as volume:
        filler = fill(volume, ROOM)
        cache = volume / "accel-cache"
        run, stderr = run_probe(cache, tmp_path / "full.pt", eager=tmp_path / "eager.pt")
        eager = torch.load(tmp_path / "eager.pt")
        assert_close_to_eager(torch.load(tmp_path / "full.pt"), eager, "compiled on a full disk")
        # still compiled: only the persistence went
        assert run["compiles"] > 0 and set(run["paths"].values()) == {"compiled"}, run
        (environment,) = run["compile_cache"]["environments"]
        assert environment["writable"] is False and "No space left" in environment["problem"], environment
        warnings = [line for line in stderr.splitlines() if "[Accel] compile cache:" in line]
        assert len(warnings) == 1, warnings
        assert str(cache) in warnings[0] and "ACCEL_CACHE_DIR" in warnings[0], warnings[0]
        assert "runs eagerly" not in stderr, stderr[-3000:]

        # room again: the next process compiles into the cache and keeps it
        filler.unlink()
        again, _ = run_probe(cache, tmp_path / "again.pt")
        assert_close_to_eager(torch.load(tmp_path / "again.pt"), eager, "compiled once there is room again")
        (environment,) = again["compile_cache"]["environments"]
        assert environment["writable"] is True and environment["artifacts_saved"] > 0, environment

        # full again while a process loads those artifacts into torch's caches: the write fails, not the files,
        # which stay for the processes after it (before, each was deleted as damaged)
        env_dir = cache / environment["env_id"]
        artifacts = sorted((env_dir / "artifacts").glob("*/*.bin"))
        assert artifacts, environment
        shutil.rmtree(env_dir / "inductor")  # torch's caches to be written again from the artifacts
        fill(volume, 0)
        store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
        loading = store.EnvironmentCache(cache, "cpu")
        assert loading.dir == env_dir and loading.check_usable()
        assert not any(loading.load_file(path) for path in artifacts)
        assert all(path.exists() for path in artifacts), "an artifact was deleted for a full disk"
        assert loading.stats["artifacts_not_loaded"] == len(artifacts) and not loading.usable, loading.stats


def test_a_damaged_shares_file_is_measured_again_and_rewritten(engine, tmp_path, monkeypatch):
    saved_findings = engine.saved_findings
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))  # a cache of this test's own
    path = saved_findings._path("cpu")
    path.write_text('{"kind-a": 0.4, "kind-b"')  # cut off, as by a full disk under an older writer
    saved_findings._known.pop(path, None)
    assert saved_findings.saved_share("cpu", "kind-a") is None  # damaged: nothing trusted from it
    saved_findings.save_shares("cpu", {"kind-a": 0.25})  # measured again
    assert json.loads(path.read_text()) == {"kind-a": 0.25}
    saved_findings._known.pop(path, None)  # as a later process reads it
    assert saved_findings.saved_share("cpu", "kind-a") == 0.25


def test_a_damaged_fingerprint_is_said_left_out_of_an_export_and_written_again(accel_pack, tmp_path, monkeypatch,
                                                                                  capsys):
    """Before, reading it raised: GET /accel/cache answered 500, so the panel showed no Clear button, and `cache
    info` and `cache export` ended in a traceback; nothing wrote it again."""
    import importlib

    store = importlib.import_module(accel_pack.__name__ + ".accel.cache.store")
    cli = importlib.import_module(accel_pack.__name__ + ".accel.__main__")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable() and store.read_fingerprint(env.dir) == env.fingerprint
    (env.dir / "fingerprint.json").write_text("")  # a disk that filled up, a copy cut short
    (info,) = store.disk_info(tmp_path / "cache")["environments"]
    assert info["env_id"] == env.dir.name and "damaged" in info["fingerprint"]["unreadable"], info
    capsys.readouterr()
    assert cli.main(["cache", "info"]) == 0 and "damaged" in capsys.readouterr().out
    assert cli.main(["cache", "export", str(tmp_path / "cache.zip")]) == 0
    assert "0 files of 0 environments" in capsys.readouterr().out  # no import could check it against a machine
    again = store.EnvironmentCache(tmp_path / "cache", "cpu")  # the environment's next use, in a later process
    assert again.check_usable() and store.read_fingerprint(env.dir) == env.fingerprint


def test_a_cache_cap_of_inf_nan_or_a_word_never_fails_the_size_check(accel_pack, tmp_path, monkeypatch, caplog):
    """ACCEL_CACHE_MAX_GB=inf is no cap; nan, -inf or a word are said in the log and the default cap is used. The
    size check runs after each save, at the end of a compile's cache scope: before, inf and nan raised there,
    which the scope took for damaged torch files, setting torch's cache aside and compiling again."""
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    cache = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert cache.check_usable()
    for value in ("inf", "nan", "-inf", "lots"):
        monkeypatch.setenv("ACCEL_CACHE_MAX_GB", value)
        caplog.clear()
        cache.evict_if_needed(force=True)
        said = [r.getMessage() for r in caplog.records if "ACCEL_CACHE_MAX_GB" in r.getMessage()]
        assert (said == []) if value == "inf" else (len(said) == 1 and "using 10" in said[0]), (value, said)
    assert cache.dir.is_dir() and cache.stats["evicted"] == 0, cache.stats


def test_the_cache_commands_meet_a_damaged_file_or_an_unusable_path_with_what_to_do(accel_pack, tmp_path,
                                                                                     monkeypatch, capsys):
    """`python -m accel cache`, each case found by a review:
    - a damaged findings file on the exporting machine (the pack reads it as none) is left out of the export,
      which imports: before, import refused the whole archive for it;
    - an archive with a byte changed is refused as damaged, nothing imported: before, a BadZipFile traceback;
    - an export to a path it cannot make, and an import of a file that is not there, name the path and what to
      do: before, a traceback, and "not a compile cache";
    - --comfyui after the command is ComfyUI's folder: before, argparse refused it there."""
    import importlib
    import zipfile

    store = importlib.import_module(accel_pack.__name__ + ".accel.cache.store")
    cli = importlib.import_module(accel_pack.__name__ + ".accel.__main__")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable()
    (env.dir / store.SHARES_FILE).write_text('{"kind-a": 0.2, "kind-')  # cut short
    (env.dir / store.IN_PIECES_FILE).write_text("{}")
    archive = tmp_path / "cache.zip"
    assert cli.main(["cache", "export", str(archive)]) == 0
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "imported"))
    assert cli.main(["cache", "import", str(archive)]) == 0, capsys.readouterr().err
    assert "exported 1 files of 1 environments" in capsys.readouterr().out  # the findings file that was whole
    assert not (tmp_path / "imported" / env.dir.name / store.SHARES_FILE).exists()

    with zipfile.ZipFile(archive) as opened:  # one byte of the findings file's data changed: its CRC fails
        entry = opened.getinfo(f"{env.dir.name}/{store.IN_PIECES_FILE}")
    data = bytearray(archive.read_bytes())
    data[entry.header_offset + 30 + len(entry.filename.encode()) + len(entry.extra)] ^= 0xFF
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(bytes(data))
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "from-damaged"))
    assert cli.main(["cache", "import", str(damaged)]) == 2
    said = capsys.readouterr().err
    assert "is damaged or cut short" in said and "Nothing was imported" in said, said
    assert not (tmp_path / "from-damaged").exists()

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["cache", "export", str(tmp_path / "a-file" / "out.zip")]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"error: cannot use {tmp_path / 'a-file'}") and "permissions" in said, said
    assert cli.main(["cache", "import", str(tmp_path / "missing.zip")]) == 2
    assert "missing.zip does not exist" in capsys.readouterr().err
    monkeypatch.delenv("ACCEL_CACHE_DIR")
    assert cli.main(["cache", "info", "--comfyui", str(tmp_path / "nowhere")]) == 2
    assert f"no ComfyUI at {tmp_path / 'nowhere'}" in capsys.readouterr().err


def test_an_environment_cleared_by_another_process_is_listed_again_at_the_next_save(accel_pack, tmp_path):
    """`python -m accel cache clear` while a ComfyUI runs removes the server's environment; the server's next save
    writes its fingerprint.json again, so `cache info`, export and the next clear see what it saves. Before, they
    passed over that folder until the server restarted (found by a review)."""
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable()
    shutil.rmtree(env.dir)  # what `cache clear` in another process does
    env.save_precompiled("key-a", "0" * 20, b"a function", "a kind", {})
    (listed,) = store.disk_info(tmp_path / "cache")["environments"]
    assert listed["env_id"] == env.dir.name and store.read_fingerprint(env.dir) == env.fingerprint, listed


def test_a_precompiled_file_of_another_format_counts_as_none(accel_pack, tmp_path):
    """background/decision.py sends a kind to a child unless its key has a precompiled function this pack loads:
    a file of another format (written before precompiled.FORMAT changed) is skipped when loading, so counting it
    would leave the kind to Dynamo in a prompt (3 compiles on the small SD1.5 UNet, measured 2026-11-27)."""
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    precompiled = sys.modules[accel_pack.__name__ + ".accel.compile.precompiled"]
    env = store.EnvironmentCache(tmp_path / "cache", "cpu")
    assert env.check_usable(), env.problem
    header = {"context": "a context", "inference": True}
    env.save_precompiled("somekey", "1" * 20, b"an older pack's function", "a kind",
                         {**header, "name": "1" * 20, "format": precompiled.FORMAT - 1})
    assert not env.has_precompiled("somekey", precompiled.loadable)
    env.save_precompiled("somekey", "2" * 20, b"this pack's function", "a kind",
                         {**header, "name": "2" * 20, "format": precompiled.FORMAT})
    assert env.has_precompiled("somekey", precompiled.loadable)


def test_a_damaged_background_job_fails_that_job_alone(engine, accel_pack, tmp_path, monkeypatch):
    """The child as the parent starts it (its set-up, its command), given two damaged jobs one after the other."""
    worker_module = engine.background.worker
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    env_dir = accel_pack.accel.cache.COMPILE_CACHE.environment("cpu").dir
    worker = env_dir / "jobs" / "worker-test"
    worker.mkdir(parents=True)
    (worker / "setup.json").write_text(json.dumps(worker_module.child_setup(env_dir)))
    jobs = []
    for name, content in (("job-damaged", b"\x80\x04not a pickle"), ("job-cut", b"")):
        job = env_dir / "jobs" / name
        job.mkdir()
        (job / "job.pkl").write_bytes(content)
        jobs.append(job)
    child = subprocess.run([sys.executable, "-m", "accel", "compile-worker", str(worker)], cwd=worker_module.PACK_DIR,
                           input="".join(f"{job}\n" for job in jobs), capture_output=True, text=True, timeout=300,
                           env={**os.environ, "ACCEL_CACHE_DIR": str(env_dir.parent)})
    assert child.returncode == 0, child.stderr[-3000:]
    for job in jobs:  # each job failed on its own and said why; the child went on to the next
        done = json.loads((job / worker_module.DONE_FILE).read_text())
        assert done["returncode"] == 1 and done["error"].startswith(("UnpicklingError", "EOFError")), done
    assert (worker / "setup.json").exists(), "the failed jobs' worker folder (its log) was not kept"
