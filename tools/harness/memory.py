"""Process memory for the benchmarks, from Linux's /proc: current and peak RSS, and the proportional set size of
the process with its children (inductor's compile workers are forked processes: their RSS counts the parent's
shared pages again, their PSS does not)."""
from __future__ import annotations

import gc
import os


def status_kib(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_mib() -> float:
    gc.collect()
    return status_kib("VmRSS") / 1024


def reset_peak() -> None:
    """Start the kernel's RSS high-water mark (VmHWM) afresh, so it measures what follows alone."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    return status_kib("VmHWM") / 1024


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pss_tree_mib() -> tuple[float, float]:
    """(PSS of this process, PSS of its descendants) in MiB."""
    def pss(pid) -> float:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    gc.collect()
    return pss(os.getpid()), sum(pss(child) for child in _descendants(os.getpid()))
