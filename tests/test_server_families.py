"""Flux and Wan 2.1 through a started ComfyUI server, as a user runs them over the HTTP API: UNETLoader -> Compile
Model (every default) -> KSampler -> SaveLatent, against the same workflow without Compile Model.

The server starts with an empty compile cache, so the first prompt meets the background compile: its blocks run
eagerly while a child compiles them, and its latent equals eager bit for bit. Once the child is done, its graphs
load (on the CPU while the server idles, so the next prompt compiles nothing; elsewhere at that prompt's calls),
the next prompt equals eager within the compiled tolerance, and a third compiles nothing.
Conditioning comes from a test-only node (tools/server_nodes/), not from text encoders.

This is where Flux's defaults are checked (test_compile_families.py checks the other image families'
in-process; test_compile_flux.py checks Flux always compiled, with LoRAs, a replaced block, partial loading):
the 3072-wide child compile is paid once in CI, here.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from compile_helpers import assert_close_to_eager
from tools.comfy_server import ComfyServer
from tools.families import BY_FAMILY
from tools.soak_prompts import TEST_NODES, latent_of

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    """Two OpenMP threads (the suite's processes run with one, where no pool starts and none could be seen), whose
    idle threads sleep rather than spin (the other test process needs the second core): every output here is
    compared with eager of the same server."""
    base = tmp_path_factory.mktemp("family-server")
    env = {"ACCEL_CACHE_DIR": str(base / "compile-cache"), "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    with ComfyServer(base, extra_nodes=(TEST_NODES,), env=env, api_nodes=False) as srv:
        yield srv


@contextlib.contextmanager
def pools_of_pack_threads(server, every: float = 0.5):
    """What the server's stats said, while the block ran, of native threads started by the pack's own threads
    (accel/thread_names.py): an OpenMP pool of a thread that ran CPU kernels beside the sampler (#32)."""
    seen, stop = [], threading.Event()

    def poll() -> None:
        while not stop.wait(every):
            pools = server.get_json("/accel/stats")["threads"]["pack_thread_pools"]
            if pools:
                seen.append(pools)

    poller = threading.Thread(target=poll, name="pack-pool-poller")
    poller.start()
    try:
        yield seen
    finally:
        stop.set()
        poller.join()


def workflow(family: str, seed: int, prefix: str, compiled: bool) -> dict:
    case = BY_FAMILY[family]
    model = ["1", 0]
    graph = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": case.file_name, "weight_dtype": "default"}},
        "2": {"class_type": "AccelTestInputs", "inputs": {"family": family, "seed": seed, "tokens": case.tokens}},
        "4": {"class_type": "KSampler", "inputs": {
            "model": model, "seed": seed, "steps": 2, "cfg": case.cfg, "sampler_name": "euler",
            "scheduler": "normal", "positive": ["2", 0], "negative": ["2", 1], "latent_image": ["2", 2],
            "denoise": 1.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": prefix}},
    }
    if compiled:  # the node's defaults, as the web UI adds it
        graph["3"] = {"class_type": "AccelCompileModel", "inputs": {
            "model": ["1", 0], "mode": "default", "dynamic": "auto", "scope": "auto"}}
        graph["4"]["inputs"]["model"] = ["3", 0]
    return graph


def run_latent(server, graph: dict) -> torch.Tensor:
    return latent_of(server, graph, graph["5"]["inputs"]["filename_prefix"])


@pytest.mark.parametrize("family", [
    pytest.param("flux", marks=pytest.mark.full(why=(
        "Flux's defaults over HTTP (a 3072-wide model); make test runs Wan 2.1's here and Flux's in process "
        "(test_compile_flux.py) and in its template (test_templates.py)"))),
    "wan21"])
def test_compile_model_defaults_over_http_equal_eager(family_server, family):
    """Also: none of the pack's threads (the loader, inductor's CPU checks, the idle gate, the job's watcher) runs
    CPU kernels, so none opens an OpenMP pool beside the prompt thread's, whose threads would spin against the
    sampler's in every later step (#32: a process that loaded its graphs stepped slower than one that compiled)."""
    eager = {seed: run_latent(family_server, workflow(family, seed, f"{family}-eager-{seed}", False))
             for seed in (1, 2)}
    with pools_of_pack_threads(family_server) as pools:
        first = run_latent(family_server, workflow(family, 1, f"{family}-first", True))
        background = family_server.wait_for_background()
        second = run_latent(family_server, workflow(family, 2, f"{family}-second", True))
    threads = family_server.get_json("/accel/stats")["threads"]
    assert not pools and threads["pack_thread_pools"] == {}, (pools, threads["per_thread"])
    assert "accel-loader" in {t["name"] for t in threads["per_thread"]}, "the loader is not named: nothing was seen"
    assert threads["torch"]["num_threads"] == 2, "the report, made off the event loop, lost the server's count"
    assert torch.equal(first, eager[1]), "the first prompt, while the child compiles, differs from eager"
    jobs = background["finished"]
    assert jobs and all(not job["failed"] for job in jobs), jobs
    assert_close_to_eager(second, eager[2], f"{family}: with the child's graphs")
    stats = family_server.get_json("/accel/stats")["compile"]
    # the child's graphs are served whole (precompiled.py): the server never runs Dynamo
    assert stats["totals"]["compiles"] == 0, f"the server ran Dynamo: {stats['totals']}"
    kinds = [k for k in stats["kinds"] if k["background"]["state"] == "done"]
    assert kinds and all(k["precompiled"]["functions"] >= 1 for k in kinds), \
        [(k["kind"], k["precompiled"], k["background"], k["eager_calls"]) for k in kinds]
    assert any(k["precompiled"]["calls"] for k in kinds), kinds
    labels = [k["kind"] for k in kinds]
    assert len(set(labels)) == len(labels), f"two kinds share a label: {labels}"
    compiles = stats["totals"]["compiles"]
    third = run_latent(family_server, workflow(family, 3, f"{family}-third", True))
    assert torch.isfinite(third).all()
    after = family_server.get_json("/accel/stats")["compile"]
    assert after["totals"]["compiles"] == compiles, f"a repeat compiled: {after['kinds']}"


def test_deepcache_on_a_model_it_cannot_serve_says_so_on_its_node(family_server):
    """Lumina 2's block loop takes no block patches: DeepCache passes the model through, the prompt completes with
    the model's own output, and the node's status line says so (state "off", with the reason), where before it
    said nothing at all."""
    graph = workflow("lumina2", 1, "lumina2-deepcache", False)
    graph["3"] = {"class_type": "AccelDeepCache", "inputs": {
        "model": ["1", 0], "cache_interval": 3, "cache_depth": 0, "start_percent": 0.0, "end_percent": 1.0,
        "schedule": "uniform"}}
    graph["4"]["inputs"]["model"] = ["3", 0]
    graph["4"]["inputs"]["steps"] = 1
    out = run_latent(family_server, graph)
    assert torch.isfinite(out).all()
    status = family_server.get_json("/accel/status")["3"]
    assert status["feature"] == "deepcache" and status["state"] == "off", status
    assert "passes the model through unchanged" in status["text"] and "NextDiT" in status["text"], status
