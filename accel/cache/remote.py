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
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

from ..env_settings import env_switch

log = logging.getLogger("comfyui_accel")

URL_ENV = "ACCEL_REMOTE_CACHE"
KEY_ENV = "ACCEL_REMOTE_CACHE_KEY"
PREFIX = "accel:1"
RETRY_AFTER_S = 60.0  # after a failure the store is left alone this long: one warning per outage, not per call
CONNECT_TIMEOUT_S = 1.0
IO_TIMEOUT_S = 5.0  # an artifact is megabytes: a read of one may take a moment on a busy network
MIN_KEY_CHARS = 16
TORCH_CACHES_OFF_ENV = "ACCEL_DISABLE_REMOTE_TORCH_CACHE"  # =1: only the artifacts travel (torch_remote.py)


@dataclass(frozen=True)
class Findings:
    """One table of what auto mode found per kind, as the store holds it: a Redis hash of kind id -> the finding as
    JSON with its "mac". `signed` names what the HMAC covers (kept as first published, so stores already filled
    still verify); `value` is what a reader gets, None when the entry is out of range (refused as unsigned)."""
    table: str
    what: str  # in the log: "could not read <what>"
    refused: str  # the warning after "refusing ", %s: the kind id
    signed: Callable[[str, dict], tuple]
    value: Callable[[dict], Any]


def _share(entry: dict) -> float | None:
    share = float(entry["share"])
    return share if 0.0 <= share <= 1.0 else None


SHARES = Findings("shares", "block shares", "the block share of %s (bad signature); it is measured here instead.",
                  lambda kind_id, entry: ("share", kind_id, repr(float(entry["share"]))), _share)
# a forged entry could only make a kind run eagerly; it is signed all the same
IN_PIECES = Findings("in_pieces", "the kinds that compile in pieces",
                     "the finding that %s compiles only in pieces (bad signature); a child finds it here instead.",
                     lambda kind_id, entry: ("in_pieces", kind_id, str(entry["code"]), str(entry["why"])),
                     lambda entry: {"why": str(entry["why"]), "code": str(entry["code"])})


class RemoteStore:
    """One Redis holding the artifacts of every environment; each call names its environment."""

    def __init__(self, url: str, secret: bytes, client):
        self.url = redacted(url)
        self._secret = secret
        self._redis = client
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._refused: set[tuple[str, str, str]] = set()  # (environment, key, name): replaced when compiled here
        self._problem = ""
        self.stats = {"remote_fetched": 0, "remote_published": 0, "remote_refused": 0, "remote_errors": 0,
                      "remote_shares_fetched": 0, "torch_hits": 0, "torch_misses": 0, "torch_published": 0}
        self._endpoint = None  # torch_remote.VerifyingEndpoint, started at the first compiled call
        self._endpoint_failed = False

    # -- artifacts ------------------------------------------------------------------------------------
    def fetch(self, env_id: str, ident: str, have: set[str]) -> dict[str, bytes]:
        """The verified artifact files of compile key `ident` that are not in `have`: name -> the file's bytes.
        A file whose signature or hash does not match is left out, with a warning."""
        manifest = self._call("read the manifest", lambda: self._redis.hgetall(self._key(env_id, "man", ident)))
        wanted = {name.decode(): entry for name, entry in (manifest or {}).items() if name.decode() not in have}
        if not wanted:
            return {}
        blobs = self._call("read artifacts", lambda: self._redis.hmget(self._key(env_id, "art", ident), list(wanted)))
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
        def write():
            refused = (env_id, ident, name) in self._refused
            if not refused and self._redis.hexists(self._key(env_id, "man", ident), name):
                return False
            digest = hashlib.sha256(data).hexdigest()
            entry = {"sha256": digest, "size": len(data), "label": label,
                     "mac": self._mac(env_id, "artifact", ident, name, digest, str(len(data)))}
            pipe = self._redis.pipeline()  # one MULTI: readers see the file and its manifest entry, or neither
            pipe.hset(self._key(env_id, "art", ident), name, data)
            pipe.hset(self._key(env_id, "man", ident), name, json.dumps(entry))
            pipe.sadd(self._key(env_id, "keys"), ident)
            pipe.set(self._key(env_id, "fingerprint"), json.dumps(fingerprint, sort_keys=True))
            pipe.execute()
            return True

        published = self._call("publish an artifact", write)
        if published:
            self.stats["remote_published"] += 1
        return bool(published)

    # -- what auto mode found per kind (compile/saved_findings.py): signed tables, kind id -> finding ----------
    def shares(self, env_id: str) -> dict[str, float]:
        found = self._read_findings(env_id, SHARES)
        self.stats["remote_shares_fetched"] += len(found)
        return found

    def publish_shares(self, env_id: str, shares: dict[str, float]) -> None:
        self._publish_findings(env_id, SHARES, {kind_id: {"share": float(share)} for kind_id, share in shares.items()})

    def in_pieces(self, env_id: str) -> dict[str, dict]:
        return self._read_findings(env_id, IN_PIECES)

    def publish_in_pieces(self, env_id: str, found: dict[str, dict]) -> None:
        self._publish_findings(env_id, IN_PIECES, found)

    def _read_findings(self, env_id: str, findings: Findings) -> dict:
        """The table's entries whose HMAC verifies and whose value is valid; each other one is counted and
        refused with a warning, and this worker finds it itself."""
        found = self._call(f"read {findings.what}",
                           lambda: self._redis.hgetall(self._key(env_id, findings.table))) or {}
        out = {}
        for kind_id, raw in found.items():
            kind_id = kind_id.decode()
            try:
                entry = json.loads(raw)
                value = findings.value(entry)
                good = value is not None and hmac.compare_digest(
                    entry["mac"], self._mac(env_id, *findings.signed(kind_id, entry)))
            except (ValueError, KeyError, TypeError):
                good = False
            if good:
                out[kind_id] = value
            else:
                self.stats["remote_refused"] += 1
                log.warning("[Accel] remote compile cache %s: refusing " + findings.refused, self.url, kind_id)
        return out

    def _publish_findings(self, env_id: str, findings: Findings, entries: dict[str, dict]) -> None:
        signed = {kind_id: json.dumps({**entry, "mac": self._mac(env_id, *findings.signed(kind_id, entry))})
                  for kind_id, entry in entries.items()}
        if signed:
            self._call(f"publish {findings.what}",
                       lambda: self._redis.hset(self._key(env_id, findings.table), mapping=signed))

    # -- torch's own remote caches (torch_remote.py) ---------------------------------------------------------
    def torch_get(self, env_id: str, key: str) -> bytes | None:
        """torch's entry under `key`, when its signature verifies; None (a miss) otherwise."""
        found = self._call("read a torch cache entry",
                           lambda: self._redis.hmget(self._key(env_id, "torch", key), ["data", "mac"]))
        data, mac = found if found else (None, None)
        if data is None:
            self.stats["torch_misses"] += 1
            return None
        good = mac is not None and hmac.compare_digest(mac.decode(errors="replace"), self._torch_mac(env_id, key, data))
        if not good:
            self.stats["remote_refused"] += 1
            self.stats["torch_misses"] += 1
            log.warning("[Accel] remote compile cache %s: refusing torch's cache entry %s (not signed with this "
                        "worker's %s, or changed in the store). It is not loaded; this worker compiles instead.",
                        self.url, key, KEY_ENV)
            return None
        self.stats["torch_hits"] += 1
        return data

    def torch_put(self, env_id: str, key: str, data: bytes) -> None:
        def write():
            self._redis.hset(self._key(env_id, "torch", key),
                             mapping={"data": data, "mac": self._torch_mac(env_id, key, data)})
            return True

        if self._call("publish a torch cache entry", write):
            self.stats["torch_published"] += 1

    def torch_endpoint(self):
        """The verifying endpoint torch's Redis client is pointed at (started once), or None where it cannot run
        or ACCEL_DISABLE_REMOTE_TORCH_CACHE=1: then torch's own remote caches stay off and the artifacts alone
        travel."""
        from .torch_remote import VerifyingEndpoint, can_serve

        if env_switch(TORCH_CACHES_OFF_ENV) is not None:
            return None
        with self._lock:
            if self._endpoint is None and not self._endpoint_failed:
                try:
                    if not can_serve():
                        raise OSError("this platform has no Unix sockets")
                    self._endpoint = VerifyingEndpoint(self)
                except OSError as err:
                    self._endpoint_failed = True
                    log.warning("[Accel] remote compile cache %s: torch's own FX graph and AOTAutograd remote "
                                "caches stay off (%s); compile keys' artifacts still travel through the store.",
                                self.url, err)
            return self._endpoint

    def _torch_mac(self, env_id: str, key: str, data: bytes) -> str:
        return self._mac(env_id, "torch", key, hashlib.sha256(data).hexdigest(), str(len(data)))

    # -- the command line -----------------------------------------------------------------------------
    def info(self, env_id: str) -> dict:
        """What the store holds for this environment (`python -m accel cache info`)."""
        def read():
            idents = sorted(i.decode() for i in self._redis.smembers(self._key(env_id, "keys")))
            files = sizes = 0
            for ident in idents:
                entries = self._redis.hvals(self._key(env_id, "man", ident))
                files += len(entries)
                sizes += sum(json.loads(entry).get("size", 0) for entry in entries)
            torch_entries = sum(1 for _ in self._redis.scan_iter(match=self._key(env_id, "torch", "*"), count=500))
            return {"keys": len(idents), "artifacts": files, "megabytes": round(sizes / 2**20, 1),
                    "shares": self._redis.hlen(self._key(env_id, "shares")),
                    "in_pieces": self._redis.hlen(self._key(env_id, "in_pieces")), "torch_entries": torch_entries}

        return {"url": self.url, "env_id": env_id, **(self._call("read what it holds", read, quiet=True) or
                                                       {"problem": self._problem})}

    def clear(self, env_id: str) -> int:
        """Delete this environment's entries (`cache clear --remote`); other environments' stay. The number of
        Redis keys removed; -1 when the store failed."""
        def delete():
            names = list(self._redis.scan_iter(match=self._key(env_id, "*"), count=500))
            return self._redis.delete(*names) if names else 0

        removed = self._call("clear this environment", delete, quiet=True)
        return -1 if removed is None else int(removed)

    def describe(self) -> dict:
        return {"url": self.url, "available": time.monotonic() >= self._down_until, "problem": self._problem,
                **self.stats, "torch_endpoint": None if self._endpoint is None else self._endpoint.url,
                "torch_counters": torch_remote_counters()}

    # -- internals ------------------------------------------------------------------------------------
    def _key(self, env_id: str, *parts: str) -> str:
        return ":".join((PREFIX, env_id, *parts))

    def _mac(self, env_id: str, *parts: str) -> str:
        message = "\n".join((PREFIX, env_id, *parts)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def _refusal(self, env_id: str, ident: str, name: str, raw_entry: bytes, data: bytes | None) -> str:
        """Why the file `data` under manifest entry `raw_entry` must not be loaded; "" when it may."""
        if data is None:
            return "the manifest names a file the store does not hold"
        try:
            entry = json.loads(raw_entry)
            digest, size, mac = entry["sha256"], int(entry["size"]), entry["mac"]
        except (ValueError, KeyError, TypeError):
            return "its manifest entry is unreadable"
        if not hmac.compare_digest(str(mac), self._mac(env_id, "artifact", ident, name, str(digest), str(size))):
            return f"its manifest entry is not signed with this worker's {KEY_ENV}"
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return "the file does not match its signed hash: changed or truncated in the store"
        return ""

    def _call(self, what: str, action, quiet: bool = False):
        """`action()`, or None when the store is resting after a failure or fails now (warned once per outage)."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return action()
        except Exception as err:  # redis' errors, timeouts, refused connections: the local path goes on
            with self._lock:
                self.stats["remote_errors"] += 1
                self._problem = f"{type(err).__name__}: {err}"
                warn = time.monotonic() >= self._down_until
                self._down_until = time.monotonic() + RETRY_AFTER_S
            if warn and not quiet:
                log.warning("[Accel] remote compile cache %s: could not %s (%s). This worker goes on with its local "
                            "cache and compiles what it lacks; the store is tried again in %.0f s.", self.url, what,
                            self._problem, RETRY_AFTER_S)
            return None


def torch_remote_counters() -> dict[str, dict[str, int]]:
    """torch's own counters of its remote caches in this process (hit, miss, put, exception per cache class, as
    TORCH_LOGS=cache prints them), where this torch keeps them."""
    try:
        from torch._inductor.remote_cache import cache_stats
    except ImportError:
        return {}
    return {name: {"hit": stat.hit, "miss": stat.miss, "put": stat.put, "exception": stat.exception}
            for name, stat in dict(getattr(cache_stats, "_stats", {})).items()}


def redacted(url: str) -> str:
    """The URL without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


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
