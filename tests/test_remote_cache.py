"""A fleet compiles once (#17): the compile cache on a shared Redis (accel/cache/remote.py), against a real
redis-server on a loopback port (tools/redis_server.py).

Two started ComfyUI servers with separate, empty cache directories and one store: the first compiles and
publishes; the second's first sampling compiles nothing cold (torch's FX graph cache hits on what the store filled
in, the pack's stats count it) and equals the first's output bit for bit; with the store stopped mid-run a prompt
completes, with one warning. In the test process, on the pack's cache classes and the same real Redis: an
artifact changed in the store is refused and the worker's own compile replaces it, another environment's
fingerprint misses, another secret's artifacts and shares are refused, a store that is down answers at once, no
secret means no store, and the command line shows and clears what the store holds.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from compile_helpers import assert_close_to_eager
from soak_prompts import Prompt, cold_compiles, run_latent, server_of
from tools.redis_server import RedisServer

SECRET = "fleet-secret-0123456789abcdef"
SD3 = Prompt("sd3", model="sd3", cfg=4.5, steps=3)  # one block kind: a short compile
# Compiled in the prompt's path, so the prompt's own stats say what compiled. Each `dynamic` is a compile key of
# its own; "static" compiles the same graph as "auto" at a first size (torch's FX graph cache hits: no new compile
# to wait for).
COMPILED = replace(SD3, compiled=True, choose="always compiled", background=False)
STATIC = replace(COMPILED, dynamic="static")


def store_env(redis: RedisServer, secret: str = SECRET) -> dict:
    return {"ACCEL_REMOTE_CACHE": redis.url, "ACCEL_REMOTE_CACHE_KEY": secret}


def cache_stats(server) -> dict:
    """The server's compile-cache stats of its CPU environment (the pack's counters and the store's)."""
    envs = server.get_json("/accel/stats")["compile"]["compile_cache"]["environments"]
    return next(env for env in envs if env["fingerprint"]["device"] == "cpu")


def fx_graph(server, outcome: str) -> int:
    """torch's FX graph cache hits or misses (cold compiles) in the server's compiled calls so far."""
    return server.get_json("/accel/stats")["compile"]["totals"]["disk_cache"].get(f"fx_graph_{outcome}", 0)


@pytest.mark.server
def test_a_second_worker_compiles_nothing_cold_and_a_store_that_stops_costs_a_warning(tmp_path):
    with RedisServer(tmp_path / "redis") as redis, contextlib.ExitStack() as stack:
        first, second = (server_of(tmp_path / name, env=store_env(redis)) for name in ("first", "second"))
        for server in (first, second):
            stack.callback(server.stop)  # also after a failed start
        with ThreadPoolExecutor(2) as pool:  # the two start at once: half the waiting
            list(pool.map(lambda server: server.start(), (first, second)))
        eager = run_latent(first, SD3, "eager")
        published = run_latent(first, COMPILED, "first")
        assert_close_to_eager(published, eager, "the first server")
        assert fx_graph(first, "misses") > 0, "the first server compiled nothing cold"
        assert cache_stats(first)["remote"]["remote_published"] > 0, cache_stats(first)

        # The second worker's first compiled prompt: its empty directory is filled from the store, and torch's
        # own caches hit there.
        out = run_latent(second, COMPILED, "second")
        assert torch.equal(out, published), "the second worker's output differs from the first's"
        stats = cache_stats(second)
        assert stats["artifacts_from_remote"] > 0 and stats["remote"]["remote_refused"] == 0, stats
        assert fx_graph(second, "misses") == 0, f"the second worker compiled cold: {cold_compiles(second)}"
        assert fx_graph(second, "hits") > 0

        # The store stops mid-run: the next prompt (a compile key the store was never asked for) completes,
        # warned once.
        redis.stop()
        out = run_latent(second, STATIC, "second-static")
        assert_close_to_eager(out, eager, "the second worker, with the store down")
        assert second.log_tail(100_000).count("goes on with its local cache") == 1, second.log_tail()
        assert cache_stats(second)["remote"]["remote_errors"] >= 1


def test_the_store_is_scoped_by_environment_and_secret(tmp_path, accel_pack, monkeypatch, caplog, capsys):
    """In the test process, on the pack's cache classes: an artifact changed in the store is refused and replaced
    by the worker's own, a worker of another environment (here: another torch) misses, a worker with another
    secret refuses what the store holds (artifacts and block shares), a store that is down costs one warning and
    no wait, and no secret means no store at all."""
    modules = sys.modules
    remote = modules[accel_pack.__name__ + ".accel.cache.remote"]
    store = modules[accel_pack.__name__ + ".accel.cache.store"]
    location = modules[accel_pack.__name__ + ".accel.cache.location"]
    with RedisServer(tmp_path / "redis") as redis:
        monkeypatch.setenv(remote.URL_ENV, redis.url)
        monkeypatch.setenv(remote.KEY_ENV, SECRET)
        publisher = store.EnvironmentCache(tmp_path / "publisher", "cpu")
        ident, name = "0123456789abcdef0123", "00112233445566778899.bin"
        data = store.pack_artifact(b"compiled code", "a block kind")
        assert remote.remote_store().publish(publisher.env_id, publisher.fingerprint, ident, name, data, "a kind")
        remote.remote_store().publish_shares(publisher.env_id, {"kind-a": 0.25})

        worker = store.EnvironmentCache(tmp_path / "worker", "cpu")  # same environment, empty directory
        assert worker.has_artifacts(ident) and (worker.artifacts_dir / ident / name).read_bytes() == data
        assert worker.stats["artifacts_from_remote"] == 1
        assert remote.remote_store().shares(worker.env_id) == {"kind-a": 0.25}

        # changed in the store, same size: the signed hash no longer matches
        client = redis.client()
        art = f"accel:1:{publisher.env_id}:art:{ident}"
        client.hset(art, name, data[:-4] + b"evil")
        changed = store.EnvironmentCache(tmp_path / "another-worker", "cpu")
        with caplog.at_level("WARNING", logger="comfyui_accel"):
            assert not changed.has_artifacts(ident), "a changed artifact was taken"
        assert "does not match its signed hash" in caplog.text
        # this worker compiles it itself, and its publish replaces the refused file
        assert remote.remote_store().publish(changed.env_id, changed.fingerprint, ident, name, data, "a kind")
        assert client.hget(art, name) == data

        other_torch = location.environment_id({**publisher.fingerprint, "torch": "2.99.0"})
        assert other_torch != publisher.env_id
        assert remote.remote_store().fetch(other_torch, ident, set()) == {}, "another environment was served"

        monkeypatch.setenv(remote.KEY_ENV, "another-fleet-secret-0123456789")
        stranger = remote.remote_store()
        with caplog.at_level("WARNING", logger="comfyui_accel"):
            assert stranger.fetch(publisher.env_id, ident, set()) == {}
            assert stranger.shares(publisher.env_id) == {}
        assert stranger.stats["remote_refused"] == 2 and "not signed with this worker's" in caplog.text

        monkeypatch.setenv(remote.KEY_ENV, SECRET)
        monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cli-cache"))
        cli = run_cli(accel_pack, ["cache", "info"], capsys)
        assert [(e["keys"], e["artifacts"], e["shares"]) for e in json.loads(cli)["remote"]] == [(1, 1, 1)], cli
        cleared = run_cli(accel_pack, ["cache", "clear", "--remote"], capsys)
        assert "removed 5 entries" in cleared, cleared  # fingerprint, key set, files, manifest, shares
        assert json.loads(run_cli(accel_pack, ["cache", "info"], capsys))["remote"][0]["keys"] == 0

        redis.stop()
        down = remote.remote_store()
        caplog.clear()
        with caplog.at_level("WARNING", logger="comfyui_accel"):
            start = time.monotonic()
            assert down.fetch(publisher.env_id, ident, set()) == {}
            assert down.fetch(publisher.env_id, ident, set()) == {}  # resting: not tried again, not warned again
            assert time.monotonic() - start < 5
        assert caplog.text.count("could not read the manifest") == 1, caplog.text

    monkeypatch.delenv(remote.KEY_ENV)
    with caplog.at_level("WARNING", logger="comfyui_accel"):
        assert remote.remote_store() is None
    assert "ACCEL_REMOTE_CACHE_KEY is missing" in caplog.text


def run_cli(pack, args: list[str], capsys) -> str:
    """`python -m accel ARGS` (the pack's command line, its main() in this process: torch is imported already)."""
    main = importlib.import_module(pack.__name__ + ".accel.__main__").main
    capsys.readouterr()
    assert main(args) == 0
    return capsys.readouterr().out
