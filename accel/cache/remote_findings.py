"""What auto mode found per kind (compile/saved_findings.py), as the remote store (remote.py) holds it: signed
tables of kind id -> finding. A forged or damaged entry is refused with a warning, and this worker finds it
itself."""
from __future__ import annotations

import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from .remote_connection import StoreConnection

log = logging.getLogger("comfyui_accel")


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


class FindingsTables:
    """Read and publish the signed tables of findings, each environment's apart."""

    def __init__(self, connection: StoreConnection):
        self.connection = connection

    def shares(self, env_id: str) -> dict[str, float]:
        found = self.read(env_id, SHARES)
        self.connection.stats["remote_shares_fetched"] += len(found)
        return found

    def publish_shares(self, env_id: str, shares: dict[str, float]) -> None:
        self.publish(env_id, SHARES, {kind_id: {"share": float(share)} for kind_id, share in shares.items()})

    def in_pieces(self, env_id: str) -> dict[str, dict]:
        return self.read(env_id, IN_PIECES)

    def publish_in_pieces(self, env_id: str, found: dict[str, dict]) -> None:
        self.publish(env_id, IN_PIECES, found)

    def read(self, env_id: str, findings: Findings) -> dict:
        """The table's entries whose HMAC verifies and whose value is valid; each other one is counted and
        refused with a warning, and this worker finds it itself."""
        conn = self.connection
        found = conn.call(f"read {findings.what}", lambda: conn.redis.hgetall(conn.key(env_id, findings.table))) or {}
        out = {}
        for kind_id, raw in found.items():
            kind_id = kind_id.decode()
            try:
                entry = json.loads(raw)
                value = findings.value(entry)
                good = value is not None and hmac.compare_digest(
                    entry["mac"], conn.mac(env_id, *findings.signed(kind_id, entry)))
            except (ValueError, KeyError, TypeError):
                good = False
            if good:
                out[kind_id] = value
            else:
                conn.stats["remote_refused"] += 1
                log.warning("[Accel] remote compile cache %s: refusing " + findings.refused, conn.url, kind_id)
        return out

    def publish(self, env_id: str, findings: Findings, entries: dict[str, dict]) -> None:
        conn = self.connection
        signed = {kind_id: json.dumps({**entry, "mac": conn.mac(env_id, *findings.signed(kind_id, entry))})
                  for kind_id, entry in entries.items()}
        if signed:
            conn.call(f"publish {findings.what}", lambda: conn.redis.hset(conn.key(env_id, findings.table),
                                                                          mapping=signed))
