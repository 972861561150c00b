"""torch's own FX graph and AOTAutograd entries in the remote store (remote.py), each signed like an artifact.
torch never talks to the store: it talks to a verifying endpoint (torch_remote.py), which reads and writes here."""
from __future__ import annotations

import hashlib
import hmac
import logging
from typing import TYPE_CHECKING

from ..env_settings import env_switch
from .remote_connection import KEY_ENV, StoreConnection

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("comfyui_accel")

TORCH_CACHES_OFF_ENV = "ACCEL_DISABLE_REMOTE_TORCH_CACHE"  # =1: only the artifacts travel (torch_remote.py)


class TorchEntries:
    """Verified reads and signed writes of torch's cache entries, and the endpoint torch is pointed at."""

    def __init__(self, connection: StoreConnection, store: RemoteStore):
        self.connection = connection
        self._store = store  # what the endpoint serves from (its torch_get / torch_put)
        self._endpoint = None  # torch_remote.VerifyingEndpoint, started at the first compiled call
        self._endpoint_failed = False

    def get(self, env_id: str, key: str) -> bytes | None:
        """torch's entry under `key`, when its signature verifies; None (a miss) otherwise."""
        conn = self.connection
        found = conn.call("read a torch cache entry",
                          lambda: conn.redis.hmget(conn.key(env_id, "torch", key), ["data", "mac"]))
        data, mac = found if found else (None, None)
        if data is None:
            conn.stats["torch_misses"] += 1
            return None
        good = mac is not None and hmac.compare_digest(mac.decode(errors="replace"), self._mac(env_id, key, data))
        if not good:
            conn.stats["remote_refused"] += 1
            conn.stats["torch_misses"] += 1
            log.warning("[Accel] remote compile cache %s: refusing torch's cache entry %s (not signed with this "
                        "worker's %s, or changed in the store). It is not loaded; this worker compiles instead.",
                        conn.url, key, KEY_ENV)
            return None
        conn.stats["torch_hits"] += 1
        return data

    def put(self, env_id: str, key: str, data: bytes) -> None:
        conn = self.connection

        def write():
            conn.redis.hset(conn.key(env_id, "torch", key), mapping={"data": data, "mac": self._mac(env_id, key, data)})
            return True

        if conn.call("publish a torch cache entry", write):
            conn.stats["torch_published"] += 1

    def endpoint(self):
        """The verifying endpoint torch's Redis client is pointed at (started once), or None where it cannot run
        or ACCEL_DISABLE_REMOTE_TORCH_CACHE=1: then torch's own remote caches stay off and the artifacts alone
        travel."""
        from .torch_remote import VerifyingEndpoint, can_serve

        if env_switch(TORCH_CACHES_OFF_ENV) is not None:
            return None
        with self.connection.lock:
            if self._endpoint is None and not self._endpoint_failed:
                try:
                    if not can_serve():
                        raise OSError("this platform has no Unix sockets")
                    self._endpoint = VerifyingEndpoint(self._store)
                except OSError as err:
                    self._endpoint_failed = True
                    log.warning("[Accel] remote compile cache %s: torch's own FX graph and AOTAutograd remote "
                                "caches stay off (%s); compile keys' artifacts still travel through the store.",
                                self.connection.url, err)
            return self._endpoint

    def endpoint_url(self) -> str | None:
        """The endpoint's address once started (the stats), without starting it."""
        return None if self._endpoint is None else self._endpoint.url

    def _mac(self, env_id: str, key: str, data: bytes) -> str:
        return self.connection.mac(env_id, "torch", key, hashlib.sha256(data).hexdigest(), str(len(data)))
