"""The main job: a generated SD1.5 model through a workflow with the pack's nodes, on a headless ComfyUI server.

Starts ComfyUI (`main.py --cpu`) with this pack in custom_nodes, submits example_workflows/accel_txt2img_api.json
over the HTTP API twice (the second time with another seed, as a user's next prompt), and prints per-node
timings from ComfyUI's websocket and what each Accel node did (from GET /accel/stats).

The compiled graphs persist in `.comfyui/demo-accel-cache` (or $ACCEL_CACHE_DIR): run the demo a second time and
its new server process finds them there (the disk-cache line says how many).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

from tools.comfy_env import ROOT, comfyui_dir, comfyui_version  # noqa: E402
from tools.comfy_server import ComfyServer, load_workflow  # noqa: E402

WORKFLOW = "accel_txt2img_api.json"


def node_timings(server: ComfyServer, graph: dict) -> tuple[dict, dict, float]:
    """Run `graph`, timing each node from the websocket's `executing` messages."""
    import websocket

    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}", timeout=600)
    try:
        start = time.perf_counter()
        prompt_id = server.queue_prompt(graph)
        timings, current, since = {}, None, start
        while True:
            message = ws.recv()
            if not isinstance(message, str):
                continue  # binary preview frames
            event = json.loads(message)
            data = event.get("data", {})
            if data.get("prompt_id") != prompt_id:
                continue
            if event["type"] in ("executing", "execution_success", "execution_error", "execution_interrupted"):
                now = time.perf_counter()
                if current is not None:
                    timings[current] = timings.get(current, 0.0) + now - since
                current, since = data.get("node"), now
                if event["type"] == "execution_error":
                    raise RuntimeError(f"workflow failed in node {data.get('node_id')}: "
                                       f"{data.get('exception_message')}")
                if event["type"] == "executing" and data.get("node") is None:
                    break
        total = time.perf_counter() - start
    finally:
        ws.close()
    return timings, server.wait_for(prompt_id), total


def describe(event: dict) -> str:
    details = event.get("options") or {k: v for k, v in event.items() if k not in ("time", "feature", "action")}
    return f"{event['action']} ({', '.join(f'{k}={v}' for k, v in details.items())})"



def wait_for_background_compile(server: ComfyServer, timeout: float = 900.0) -> None:
    """Compile Model's cold compiles run in a child process while the first run samples eagerly; the demo waits
    for it so that the second run shows the compiled blocks (a user's next prompt would pick them up as well)."""
    start = time.perf_counter()
    background = server.get_json("/accel/stats")["compile"]["background"]
    if not background["running"]:
        return
    print(f"\nbackground compile of {', '.join(background['running']['kinds'])}: waiting for it ...")
    while background["running"] and time.perf_counter() - start < timeout:
        time.sleep(2)
        background = server.get_json("/accel/stats")["compile"]["background"]
    for job in background["finished"]:
        print(f"  child pid {job['pid']}: {len(job['kinds'])} kinds in {job['wall_seconds']} s, peak RSS "
              f"{job['peak_rss_mib']} MiB{', failed: ' + ', '.join(job['failed']) if job['failed'] else ''}")


def main() -> None:
    import torch

    comfy = comfyui_dir()
    print(f"ComfyUI-Accel demo: ComfyUI {comfyui_version(comfy)} at {comfy}, torch {torch.__version__}, CPU")
    graph = load_workflow(WORKFLOW)
    os.environ.setdefault("ACCEL_CACHE_DIR", str(ROOT / ".comfyui" / "demo-accel-cache"))
    with tempfile.TemporaryDirectory(prefix="accel-demo-") as base:
        start = time.perf_counter()
        with ComfyServer(Path(base)) as server:
            print(f"server started in {time.perf_counter() - start:.1f} s on {server.url} (log: {server.log_path})")
            for run, seed in enumerate((42, 43), start=1):
                graph["8"]["inputs"]["seed"] = seed
                timings, entry, total = node_timings(server, graph)
                print(f"\nrun {run} (seed {seed}): {total:.2f} s end to end")
                for node_id, seconds in sorted(timings.items(), key=lambda kv: -kv[1]):
                    print(f"  {seconds:7.2f} s  node {node_id:>2} {graph[node_id]['class_type']}")
                for image in server.output_images(entry):
                    print(f"  image: {image.name} ({image.stat().st_size} bytes)")
                if run == 1:
                    wait_for_background_compile(server)
            stats = server.get_json("/accel/stats")
        print("\nwhat the pack did (GET /accel/stats):")
        latest = {(event["feature"], event["action"]): event for event in stats["events"]}
        for (feature, _), event in sorted(latest.items()):
            print(f"  {feature}: {describe(event)}")
        print(f"  counters: {json.dumps(stats['counters'])}")
        compiled = stats["compile"]
        totals = compiled["totals"]
        print(f"\ncompiled-graph registry: {totals['kinds']} block kinds, {totals['compiles']} compiles "
              f"({totals['compile_seconds']:.1f} s), {totals['cache_hits']} cache hits")
        disk = totals["disk_cache"]
        print(f"persistent compile cache {os.environ['ACCEL_CACHE_DIR']}: {disk.get('fx_graph_hits', 0)} graphs "
              f"from disk, {disk.get('fx_graph_misses', 0)} compiled anew (run the demo again: a new process "
              f"finds them on disk)")
        for kind in compiled["kinds"]:
            print(f"  {kind['kind']:<32} path={kind['path']:<8} compiles={kind['compiles']} hits={kind['cache_hits']}"
                  f"  {kind['reason']}")
        for model, check in compiled.get("whole_call_checks", {}).items():
            print(f"  whole-call check of {model}: {check['verdict']}  {check['reason']}")


if __name__ == "__main__":
    main()
