"""A background child process waiting for jobs (`python -m accel compile-worker DIR`, compile/child/serve.py), and
one job sent to it: how it is started, with which set-up, how long it waits for the next job, and how a job's end
is read."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cache.trust import make_private_dirs
from ...env_settings import env_float
from ...thread_names import start_thread
from .job_folders import folder_name

PACK_DIR = Path(__file__).resolve().parents[3]
IDLE_ENV = "ACCEL_BACKGROUND_IDLE_SECONDS"
DEFAULT_IDLE_SECONDS = {"cpu": 600.0}  # any other device: 0
DONE_FILE = "done.json"  # the child writes it last for each job: {"returncode": 0 or 1, "error": ...}


@dataclass
class Worker:
    """A child process waiting for jobs: the environment and set-up it was started with (a job for another
    environment, e.g. other ComfyUI flags, gets a child of its own)."""
    process: subprocess.Popen
    key: str
    directory: Path  # its set-up and log

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, job_directory: Path) -> None:
        self.process.stdin.write(f"{job_directory}\n".encode())
        self.process.stdin.flush()

    def retire(self) -> None:
        """No more jobs: the child ends when it reads the end of its stdin (after the job it has, if any), and is
        waited for then, in a thread of its own: nothing else holds it once retired, and an ended child nobody
        waits for stays a zombie until ComfyUI happens to start another process."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        start_thread("accel-reap", self.process.wait)


@dataclass
class Job:
    entries: list
    worker: Worker
    directory: Path
    started: float

    def ended(self) -> bool:
        return (self.directory / DONE_FILE).exists() or not self.worker.alive()


def start_worker(env_dir: Path, setup: dict, key: str) -> Worker:
    """A new child for the environment `env_dir` with this set-up (child_setup), its folder under the jobs'."""
    directory = env_dir / "jobs" / folder_name("worker")
    make_private_dirs(directory)
    (directory / "setup.json").write_text(json.dumps(setup))
    env = {**os.environ, "ACCEL_CACHE_DIR": str(env_dir.parent), "PYTHONUNBUFFERED": "1"}
    with open(directory / "log.txt", "wb") as log_file:  # the child keeps its own descriptor
        process = subprocess.Popen([sys.executable, "-m", "accel", "compile-worker", str(directory)],
                                   cwd=PACK_DIR, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE)
    return Worker(process, key, directory)


def child_setup(env_dir: Path) -> dict:
    """What makes the child's compiled code the same as this process's: ComfyUI and its flags, torch threads."""
    import comfy.model_management  # `comfy` itself is a namespace package: no __file__
    from comfy.cli_args import args

    flags = {}
    for name, value in vars(args).items():
        with contextlib.suppress(TypeError, ValueError):
            json.dumps(value)
            flags[name] = value
    return {"comfyui": str(Path(comfy.model_management.__file__).resolve().parent.parent), "flags": flags,
            "threads": torch.get_num_threads(), "parent": os.getpid(), "env_dir": str(env_dir)}


def idle_seconds(device_type: str) -> float:
    return env_float(IDLE_ENV, DEFAULT_IDLE_SECONDS.get(device_type, 0.0))


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
