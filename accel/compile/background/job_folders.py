"""The folders of background jobs and children under the cache's `jobs/`, named so that the process that made
one can be told alive or gone, and swept when it is gone."""
from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

log = logging.getLogger("comfyui_accel")
CLOCK_SLACK_S = 600.0  # _made_before_start


def folder_name(kind: str) -> str:
    """A job's or a child's folder: `<kind>-<host>-<pid>-<ns>`, so that the process that made it can be told
    alive or gone (sweep_stale_jobs), on this host only: processes of other machines or containers sharing the
    cache have their own pids."""
    return f"{kind}-{_HOST}-{os.getpid()}-{time.time_ns()}"


_HOST = "".join(c if c.isalnum() or c in "._" else "_" for c in platform.node()) or "host"


def sweep_stale_jobs(jobs_dir: Path) -> list[str]:
    """Delete the job and child folders that processes of this host which are gone left behind (a ComfyUI killed,
    say, while its child compiled). A live process's folders are kept, a failed job's log included, and so are
    other hosts' and any folder not named by folder_name. A folder made (well) before the live process of its pid
    started is an earlier process's: a container started again gives ComfyUI the same small pid every time, and
    those folders stayed forever. Returns the names deleted. POSIX only (on Windows os.kill(pid, 0) would end
    the process, not probe it)."""
    deleted = []
    if os.name != "posix":
        return deleted
    with contextlib.suppress(OSError):
        for path in jobs_dir.iterdir():
            parts = path.name.split("-")
            if len(parts) != 4 or parts[0] not in ("job", "worker") or parts[1] != _HOST or not parts[2].isdigit():
                continue
            pid = int(parts[2])
            if (pid == os.getpid() or _process_alive(pid)) and not _made_before_start(pid, parts[3]):
                continue
            shutil.rmtree(path, ignore_errors=True)
            deleted.append(path.name)
    if deleted:
        log.info("[Accel] Compile Model: removed %d background-compile folders of ComfyUI processes that ended "
                 "before their jobs did (%s)", len(deleted), jobs_dir)
    return deleted


def _made_before_start(pid: int, made_ns: str) -> bool:
    """Whether a folder named with `made_ns` (folder_name's time, the wall clock) was made before the process
    `pid` now has started (by /proc, from the boot time: False where it cannot tell). Ten minutes of slack: the
    wall clock may have been set since the boot, and a live job's folder must never go (an earlier process's
    goes at a later start)."""
    if not made_ns.isdigit():
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        with open("/proc/stat") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    started = boot + started_ticks / os.sysconf("SC_CLK_TCK")
    return int(made_ns) / 1e9 < started - CLOCK_SLACK_S


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
