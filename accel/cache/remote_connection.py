"""The connection to the fleet's Redis (remote.py) that every part of the store goes through: the names of its
keys, the HMAC that signs what is published, and what a store that is down, slow or refusing costs (one warning,
then RETRY_AFTER_S left alone)."""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("comfyui_accel")

URL_ENV = "ACCEL_REMOTE_CACHE"
KEY_ENV = "ACCEL_REMOTE_CACHE_KEY"
PREFIX = "accel:1"
RETRY_AFTER_S = 60.0  # after a failure the store is left alone this long: one warning per outage, not per call


class StoreConnection:
    """One Redis client, its secret and its outage state; the counters of every part of the store (one table in
    the stats)."""

    def __init__(self, url: str, secret: bytes, client):
        self.url = redacted(url)
        self._secret = secret
        self.redis = client
        self.lock = threading.Lock()
        self.down_until = 0.0
        self.problem = ""
        self.stats = {"remote_fetched": 0, "remote_published": 0, "remote_refused": 0, "remote_errors": 0,
                      "remote_shares_fetched": 0, "torch_hits": 0, "torch_misses": 0, "torch_published": 0}

    def key(self, env_id: str, *parts: str) -> str:
        return ":".join((PREFIX, env_id, *parts))

    def mac(self, env_id: str, *parts: str) -> str:
        message = "\n".join((PREFIX, env_id, *parts)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def call(self, what: str, action, quiet: bool = False):
        """`action()`, or None when the store is resting after a failure or fails now (warned once per outage)."""
        if time.monotonic() < self.down_until:
            return None
        try:
            return action()
        except Exception as err:  # redis' errors, timeouts, refused connections: the local path goes on
            with self.lock:
                self.stats["remote_errors"] += 1
                self.problem = f"{type(err).__name__}: {err}"
                warn = time.monotonic() >= self.down_until
                self.down_until = time.monotonic() + RETRY_AFTER_S
            if warn and not quiet:
                log.warning("[Accel] remote compile cache %s: could not %s (%s). This worker goes on with its local "
                            "cache and compiles what it lacks; the store is tried again in %.0f s.", self.url, what,
                            self.problem, RETRY_AFTER_S)
            return None


def redacted(url: str) -> str:
    """The URL without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))
