"""The main job: a generated SD1.5 model through a workflow with the pack's nodes, on a headless ComfyUI server,
against the same workflow on a ComfyUI server without the pack.

Starts ComfyUI (`main.py --cpu`) twice: first without the pack, running tools/workflows/accel_txt2img_api.json
with the pack's nodes taken out (each one's input wired straight through), then with the pack in custom_nodes,
running the workflow as it is. Each server gets the prompt three times over the HTTP API (other seeds, as a
user's next prompts); the pack's first prompt is followed by its background compile. It prints per-node timings
from ComfyUI's websocket, the first prompt and the steady prompt (the third) side by side, and what each Accel
node did (from GET /accel/stats). Every scenario on two model families: `make bench` (docs/benchmarks/REPORT.md).

The compiled graphs persist in `.comfyui/demo-accel-cache` (or $ACCEL_CACHE_DIR): run the demo a second time and
its new server process finds them there (the disk-cache line says how many).
"""
from __future__ import annotations

import copy
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
    if not background["busy"]:
        return
    kinds = (background["running"] or {}).get("kinds") or background["held_until_idle"] or ["kinds in the cache"]
    print(f"\nbackground compile of {', '.join(kinds)}: waiting for it ...")
    while background["busy"] and time.perf_counter() - start < timeout:  # held work starts now: the server idles
        time.sleep(1)
        background = server.get_json("/accel/stats")["compile"]["background"]
    for job in background["finished"]:
        peak = f", peak RSS {job['peak_rss_mib']} MiB" if job.get("peak_rss_mib") else ""
        print(f"  child pid {job['pid']}: {len(job['kinds'])} kinds in {job['wall_seconds']} s{peak}"
              f"{', failed: ' + ', '.join(job['failed']) if job['failed'] else ''}")


def without_pack(graph: dict) -> dict:
    """The same workflow with the pack's nodes taken out: whatever read an Accel node's output reads that node's
    own MODEL or VAE input instead."""
    graph = copy.deepcopy(graph)
    accel = {node_id for node_id, node in graph.items() if node["class_type"].startswith("Accel")}

    def source(link):
        while isinstance(link, list) and link[0] in accel:
            link = next(v for v in graph[link[0]]["inputs"].values() if isinstance(v, list))
        return link

    for node in graph.values():
        node["inputs"] = {name: source(value) for name, value in node["inputs"].items()}
    return {node_id: node for node_id, node in graph.items() if node_id not in accel}


def run_prompts(server: ComfyServer, graph: dict, with_pack: bool) -> list[tuple[dict, float]]:
    """The workflow three times (seeds 42, 43, 44); with the pack, its background compile after the first."""
    runs = []
    for run, seed in enumerate((42, 43, 44), start=1):
        graph["8"]["inputs"]["seed"] = seed
        timings, entry, total = node_timings(server, graph)
        runs.append((timings, total))
        print(f"\nrun {run} (seed {seed}): {total:.2f} s end to end")
        for node_id, seconds in sorted(timings.items(), key=lambda kv: -kv[1]):
            print(f"  {seconds:7.2f} s  node {node_id:>2} {graph[node_id]['class_type']}")
        for image in server.output_images(entry):
            print(f"  image: {image.name} ({image.stat().st_size} bytes)")
        if run == 1 and with_pack:
            wait_for_background_compile(server)
    return runs


def side_by_side(graph: dict, plain: list[tuple[dict, float]], accel: list[tuple[dict, float]]) -> None:
    """First prompt and steady prompt (the third), without and with the pack, in total and per sampling node."""
    print("\nthe same workflow without and with the pack (this run, this machine):")
    print(f"  {'':<26}{'without':>10}{'with':>10}   with / without")
    for label, index in (("first prompt", 0), ("steady prompt (run 3)", 2)):
        without, with_ = plain[index][1], accel[index][1]
        print(f"  {label:<26}{without:>9.2f}s{with_:>9.2f}s   {with_ / without:.2f}x the time")
        for node_id in ("8", "11"):  # KSampler and VAE Decode: what the pack's nodes act on
            a, b = plain[index][0].get(node_id), accel[index][0].get(node_id)
            if a and b:
                print(f"    {graph[node_id]['class_type']:<24}{a:>9.2f}s{b:>9.2f}s   {b / a:.2f}x the time")
    print("  every scenario on SD1.5 and Flux, with charts: make bench -> docs/benchmarks/REPORT.md")


def main() -> None:
    import torch

    comfy = comfyui_dir()
    print(f"ComfyUI-Accel demo: ComfyUI {comfyui_version(comfy)} at {comfy}, torch {torch.__version__}, CPU")
    graph = load_workflow(WORKFLOW)
    os.environ.setdefault("ACCEL_CACHE_DIR", str(ROOT / ".comfyui" / "demo-accel-cache"))
    with tempfile.TemporaryDirectory(prefix="accel-demo-") as base:
        print("\n== ComfyUI without the pack, the workflow without its nodes")
        with ComfyServer(Path(base) / "plain", with_pack=False) as server:
            plain = run_prompts(server, without_pack(graph), with_pack=False)
        print("\n== ComfyUI with the pack, the workflow as it is")
        start = time.perf_counter()
        with ComfyServer(Path(base) / "accel") as server:
            print(f"server started in {time.perf_counter() - start:.1f} s on {server.url} (log: {server.log_path})")
            accel = run_prompts(server, graph, with_pack=True)
            stats = server.get_json("/accel/stats")
            statuses = server.get_json("/accel/status")
        side_by_side(graph, plain, accel)
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
        print("\nwhat each Accel node's status line says in the web UI (GET /accel/status):")
        for node_id, status in sorted(statuses.items()):
            name = graph.get(node_id, {}).get("class_type", "?")
            print(f"  node {node_id:>2} {name:<20} {status['state']}: {status['text']}")


if __name__ == "__main__":
    main()
