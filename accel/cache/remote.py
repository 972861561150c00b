"""The compile cache of a fleet: every worker publishes what it compiles to one Redis and looks there before it
compiles (ACCEL_REMOTE_CACHE=redis://[:password@]host:port/db, or rediss:// for TLS).

The local directory (store.py) stays the first level: a compile key's artifacts found in the store are written
into it and then loaded as any local artifact, so torch's own caches hit there. A store that is down, slow or
refuses costs one warning and the local path: the store is left alone for RETRY_AFTER_S, and each call on it is
bounded by short socket timeouts.

What the store holds is what torch runs, so reads trust nothing they cannot check. ACCEL_REMOTE_CACHE_KEY is a
secret shared by the workers that may publish; every artifact's manifest entry carries an HMAC over the
environment, compile key, file name and the file's SHA-256 under that secret, and a read loads a file only when
the HMAC and the file's own hash both match. Without the secret the store is not used at all.

Keys, all under `accel:1:<environment id>:` (location.environment_id: torch, Python, device, GPU, driver, CPU
model), so a worker with another torch or GPU misses cleanly:

    fingerprint       the environment's fingerprint, as JSON (`cache info`)
    keys              the set of compile key ids with artifacts
    art:<key id>      hash: artifact file name -> the file's bytes (store.pack_artifact's format)
    man:<key id>      hash: artifact file name -> {"sha256", "size", "label", "mac"} as JSON
    shares            hash: block kind id -> {"share", "mac"} as JSON (auto mode's measured shares)
    in_pieces         hash: block kind id -> {"why", "code", "mac"} as JSON (kinds found to compile only in
                      pieces, with a digest of the code they were found on: compile/saved_findings.py)
    torch:<key>       hash: "data" -> an entry of torch's own FX graph or AOTAutograd cache, "mac" -> its
                      signature (torch_remote.py: torch talks to a verifying endpoint, never to the store)

Two levels in the store: a compile key's artifacts (torch's Mega-Cache of the whole kind: FX graphs,
AOTAutograd entries, autotuning results), fetched before the key compiles; and torch's own per-graph entries,
which torch looks up itself when it compiles a graph no artifact carried (another compile key of the same graph,
a new input size).

Each job is a module of its own: remote_connection.py (the client, the signatures, outages), remote_findings.py (auto
mode's signed tables), remote_torch_entries.py (torch's own entries); RemoteStore, here, holds the artifacts and
hands the rest to those parts.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from urllib.parse import urlsplit

from .remote_connection import KEY_ENV, PREFIX, RETRY_AFTER_S, URL_ENV, StoreConnection, redacted
from .remote_findings import IN_PIECES, SHARES, Findings, FindingsTables
from .remote_torch_entries import TORCH_CACHES_OFF_ENV, TorchEntries

# The names the rest of the pack (and its tests) import from here, whichever part now holds them.
__all__ = ["CONNECT_TIMEOUT_S", "IN_PIECES", "IO_TIMEOUT_S", "KEY_ENV", "MIN_KEY_CHARS", "PREFIX", "RETRY_AFTER_S",
           "SHARES", "TORCH_CACHES_OFF_ENV", "URL_ENV", "Findings", "RemoteStore", "redacted", "remote_store",
           "torch_remote_counters"]

log = logging.getLogger("comfyui_accel")

CONNECT_TIMEOUT_S = 1.0
IO_TIMEOUT_S = 5.0  # an artifact is megabytes: a read of one may take a moment on a busy network
MIN_KEY_CHARS = 16


class RemoteStore:
    """One Redis holding the artifacts of every environment; each call names its environment. The artifact files
    and the store's upkeep are here; findings and torch's own entries are parts of their own."""

    def __init__(self, url: str, secret: bytes, client):
        self.connection = StoreConnection(url, secret, client)
        self.url = self.connection.url
        self.stats = self.connection.stats  # one table, counted by every part
        self._refused: set[tuple[str, str, str]] = set()  # (environment, key, name): replaced when compiled here
        self.findings = FindingsTables(self.connection)
        self.torch = TorchEntries(self.connection, self)

    # -- artifacts ------------------------------------------------------------------------------------
    def fetch(self, env_id: str, ident: str, have: set[str]) -> dict[str, bytes]:
        """The verified artifact files of compile key `ident` that are not in `have`: name -> the file's bytes.
        A file whose signature or hash does not match is left out, with a warning."""
        conn = self.connection
        manifest = conn.call("read the manifest", lambda: conn.redis.hgetall(conn.key(env_id, "man", ident)))
        wanted = {name.decode(): entry for name, entry in (manifest or {}).items() if name.decode() not in have}
        if not wanted:
            return {}
        blobs = conn.call("read artifacts", lambda: conn.redis.hmget(conn.key(env_id, "art", ident), list(wanted)))
        found = {}
        for (name, entry), data in zip(wanted.items(), blobs or []):
            why = self._refusal(env_id, ident, name, entry, data)
            if why:
                self._refused.add((env_id, ident, name))
                self.stats["remote_refused"] += 1
                log.warning("[Accel] remote compile cache %s: refusing artifact %s of key %s (%s). It is not loaded; "
                            "this worker compiles instead. Only workers with the same %s may publish.", self.url,
                            name, ident, why, KEY_ENV)
                continue
            found[name] = data
        self.stats["remote_fetched"] += len(found)
        return found

    def publish(self, env_id: str, fingerprint: dict, ident: str, name: str, data: bytes, label: str) -> bool:
        """Add one artifact file of compile key `ident`, signed; False (with the one warning) when the store
        failed. A file the store already holds under this name is left as it is, unless this worker refused it:
        then this worker's own compile replaces it, so the fleet stops compiling it again."""
        conn = self.connection

        def write():
            refused = (env_id, ident, name) in self._refused
            if not refused and conn.redis.hexists(conn.key(env_id, "man", ident), name):
                return False
            digest = hashlib.sha256(data).hexdigest()
            entry = {"sha256": digest, "size": len(data), "label": label,
                     "mac": conn.mac(env_id, "artifact", ident, name, digest, str(len(data)))}
            pipe = conn.redis.pipeline()  # one MULTI: readers see the file and its manifest entry, or neither
            pipe.hset(conn.key(env_id, "art", ident), name, data)
            pipe.hset(conn.key(env_id, "man", ident), name, json.dumps(entry))
            pipe.sadd(conn.key(env_id, "keys"), ident)
            pipe.set(conn.key(env_id, "fingerprint"), json.dumps(fingerprint, sort_keys=True))
            pipe.execute()
            return True

        published = conn.call("publish an artifact", write)
        if published:
            self.stats["remote_published"] += 1
        return bool(published)

    def _refusal(self, env_id: str, ident: str, name: str, raw_entry: bytes, data: bytes | None) -> str:
        """Why the file `data` under manifest entry `raw_entry` must not be loaded; "" when it may."""
        if data is None:
            return "the manifest names a file the store does not hold"
        try:
            entry = json.loads(raw_entry)
            digest, size, mac = entry["sha256"], int(entry["size"]), entry["mac"]
        except (ValueError, KeyError, TypeError):
            return "its manifest entry is unreadable"
        signature = self.connection.mac(env_id, "artifact", ident, name, str(digest), str(size))
        if not hmac.compare_digest(str(mac), signature):
            return f"its manifest entry is not signed with this worker's {KEY_ENV}"
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return "the file does not match its signed hash: changed or truncated in the store"
        return ""

    # -- what auto mode found per kind (remote_findings.py; saved_findings.py reads these names) ----------
    def shares(self, env_id: str) -> dict[str, float]:
        return self.findings.shares(env_id)

    def publish_shares(self, env_id: str, shares: dict[str, float]) -> None:
        self.findings.publish_shares(env_id, shares)

    def in_pieces(self, env_id: str) -> dict[str, dict]:
        return self.findings.in_pieces(env_id)

    def publish_in_pieces(self, env_id: str, found: dict[str, dict]) -> None:
        self.findings.publish_in_pieces(env_id, found)

    # -- torch's own remote caches (remote_torch_entries.py; the endpoint calls these names) ---------------
    def torch_get(self, env_id: str, key: str) -> bytes | None:
        return self.torch.get(env_id, key)

    def torch_put(self, env_id: str, key: str, data: bytes) -> None:
        self.torch.put(env_id, key, data)

    def torch_endpoint(self):
        return self.torch.endpoint()

    # -- the command line -----------------------------------------------------------------------------
    def info(self, env_id: str) -> dict:
        """What the store holds for this environment (`python -m accel cache info`)."""
        conn = self.connection

        def read():
            idents = sorted(i.decode() for i in conn.redis.smembers(conn.key(env_id, "keys")))
            files = sizes = 0
            for ident in idents:
                entries = conn.redis.hvals(conn.key(env_id, "man", ident))
                files += len(entries)
                sizes += sum(json.loads(entry).get("size", 0) for entry in entries)
            torch_entries = sum(1 for _ in conn.redis.scan_iter(match=conn.key(env_id, "torch", "*"), count=500))
            return {"keys": len(idents), "artifacts": files, "megabytes": round(sizes / 2**20, 1),
                    "shares": conn.redis.hlen(conn.key(env_id, "shares")),
                    "in_pieces": conn.redis.hlen(conn.key(env_id, "in_pieces")), "torch_entries": torch_entries}

        return {"url": self.url, "env_id": env_id, **(conn.call("read what it holds", read, quiet=True) or
                                                       {"problem": conn.problem})}

    def clear(self, env_id: str) -> int:
        """Delete this environment's entries (`cache clear --remote`); other environments' stay. The number of
        Redis keys removed; -1 when the store failed."""
        conn = self.connection

        def delete():
            names = list(conn.redis.scan_iter(match=conn.key(env_id, "*"), count=500))
            return conn.redis.delete(*names) if names else 0

        removed = conn.call("clear this environment", delete, quiet=True)
        return -1 if removed is None else int(removed)

    def describe(self) -> dict:
        conn = self.connection
        return {"url": self.url, "available": time.monotonic() >= conn.down_until, "problem": conn.problem,
                **self.stats, "torch_endpoint": self.torch.endpoint_url(), "torch_counters": torch_remote_counters()}


def torch_remote_counters() -> dict[str, dict[str, int]]:
    """torch's own counters of its remote caches in this process (hit, miss, put, exception per cache class, as
    TORCH_LOGS=cache prints them), where this torch keeps them."""
    try:
        from torch._inductor.remote_cache import cache_stats
    except ImportError:
        return {}
    return {name: {"hit": stat.hit, "miss": stat.miss, "put": stat.put, "exception": stat.exception}
            for name, stat in dict(getattr(cache_stats, "_stats", {})).items()}


_lock = threading.Lock()
_stores: dict[tuple[str, str], RemoteStore | None] = {}


def remote_store() -> RemoteStore | None:
    """The store ACCEL_REMOTE_CACHE names, or None: not set, or unusable (said once, with the fix)."""
    url = os.environ.get(URL_ENV, "").strip()
    if not url:
        return None
    secret = os.environ.get(KEY_ENV, "")
    with _lock:
        if (url, secret) not in _stores:
            _stores[(url, secret)] = _open(url, secret)
        return _stores[(url, secret)]


def _open(url: str, secret: str) -> RemoteStore | None:
    shown = redacted(url)
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        log.warning("[Accel] %s=%s is not a Redis URL; the remote compile cache is off. Use redis://host:port/db "
                    "(rediss:// for TLS, redis://:password@host:port/db with a password).", URL_ENV, shown)
        return None
    if len(secret) < MIN_KEY_CHARS:
        log.warning("[Accel] %s is set but %s is %s: the remote compile cache is off, because the store holds code "
                    "that workers run and only signed artifacts may be loaded. Set %s to the same secret of at least "
                    "%d characters on every worker that may publish (for example the output of `openssl rand -hex "
                    "32`).", URL_ENV, KEY_ENV, "missing" if not secret else "too short", KEY_ENV, MIN_KEY_CHARS)
        return None
    try:
        import redis
    except ImportError:
        log.warning("[Accel] %s is set but the Python package redis is not installed in ComfyUI's environment: the "
                    "remote compile cache is off. Install it with `pip install redis`.", URL_ENV)
        return None
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=IO_TIMEOUT_S)
    except ValueError as err:
        log.warning("[Accel] %s=%s cannot be used (%s); the remote compile cache is off.", URL_ENV, shown, err)
        return None
    log.info("[Accel] remote compile cache: %s", shown)
    return RemoteStore(url, secret.encode(), client)
