"""A background job's end, read in ComfyUI's process: the child's results handed back to the job's kinds (each one
done, its graphs to load between prompts, or failed, compiled here at its next call), one record for the stats,
and the log's line. Run on the loader thread (parent.py's poll)."""
from __future__ import annotations

import logging
import shutil
import time

from ... import telemetry
from .loader import LOADER
from .worker import DONE_FILE, Job, read_json
from .worker_keeper import WorkerKeeper

log = logging.getLogger("comfyui_accel")


def hand_back(job: Job, keeper: WorkerKeeper, history: list[dict]) -> None:
    """Hand the ended `job`'s kinds back and append its record to `history` (`keeper` forgets a child that ended
    in it)."""
    wall = time.perf_counter() - job.started
    results = read_json(job.directory / "results.json") or {}
    done = read_json(job.directory / DONE_FILE)
    if done is None:  # the child ended in the job (it crashed, or was killed)
        job.worker.process.wait()
        returncode, error = job.worker.process.returncode, None
        keeper.forget_ended(job.worker)
    else:
        returncode, error = done.get("returncode"), done.get("error")
    by_id = {r["cache_id"]: r for r in results.get("kinds", [])}
    failed = []
    for entry in job.entries:
        result = by_id.get(entry.cache_id)
        if result and not result.get("failure"):  # compiled and saved, even if the job went wrong after
            # no graph to load (child/compile_kind.compile_item stops at a graph break): the kind runs eagerly from
            # now, unless the child only saved what runs compiled here (a save: state.py's SAVE_*), which keeps running
            in_pieces = result.get("graph_breaks") and not isinstance(result.get("precompiled"), int)
            if in_pieces and entry.background.saving:
                entry.background.done(result["seconds"], str(result.get("precompiled")))
            elif in_pieces:
                entry.background.done(result["seconds"], in_pieces=str(result.get("precompiled")))
                entry.choice.compiles_only_in_pieces(str(result.get("precompiled")))
            else:
                entry.background.done(result["seconds"], result.get("precompiled"),
                                      refused=result.get("precompile_refused", False))
            entry.precompiled.due = isinstance(result.get("precompiled"), int)
        else:
            why = (result or {}).get("failure") or error or f"the child exited with code {returncode}"
            entry.background.failed(why)
            failed.append(entry.kind.label)
    LOADER.load_when_idle([e for e in job.entries if e.precompiled.due])  # between prompts
    record = {"pid": job.worker.process.pid, "kinds": [e.kind.label for e in job.entries],
              "wall_seconds": round(wall, 1), "returncode": returncode,
              "cold_graphs": sum(r.get("fx_graph_misses", 0) for r in results.get("kinds", [])),
              "peak_rss_mib": results.get("peak_rss_mib"), "failed": failed}
    history.append(record)
    telemetry.record("compile_model", "background_done", kinds=record["kinds"], failed=failed)
    if failed:
        log_path = job.worker.directory / "log.txt"
        tail = log_path.read_text(errors="replace")[-2000:]
        log.warning("[Accel] Compile Model: the background compile of %s failed; they compile at their next "
                    "call instead. The child's log (%s) ends:\n%s", ", ".join(failed), log_path, tail)
    else:
        shutil.rmtree(job.directory, ignore_errors=True)
        log.info("[Accel] Compile Model: background compile done in %.1f s (%s); the next call loads them from "
                 "the compile cache", wall, ", ".join(record["kinds"]))
