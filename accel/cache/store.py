"""The pack's persistent compile cache: torch's own on-disk caches in a directory the pack owns, plus the
portable Mega-Cache artifacts of every compiled block kind.

Layout, one directory per environment (see location.py):

    <root>/<env id>/fingerprint.json      what the artifacts were built for
    <root>/<env id>/inductor/             torch's FX graph, AOTAutograd, kernel and autotuning caches
    <root>/<env id>/artifacts/<key>/*.bin Mega-Cache artifacts of one compile key (block kind + options)
    <root>/<env id>/artifacts/<key>/last_used
    <root>/<env id>/artifacts/<key>/precompiled/*.bin  torch's AOT precompiled functions of the key's graphs
                                          (compile/precompiled.py): loaded without Dynamo tracing
    <root>/<env id>/auto_call_shares.json each block kind's share of a UNet call (compile/saved_findings.py)
    <root>/<env id>/auto_in_pieces.json   the kinds a child found compile only in pieces (compile/saved_findings.py)

With ACCEL_REMOTE_CACHE set, a compile key's artifacts are also published to a shared store, and fetched from
it (verified) into `artifacts/` when this directory lacks them (remote.py): the directory stays the first level.
torch's own FX graph and AOTAutograd remote caches are on in the same scope, through a verifying endpoint
(torch_remote.py): a graph no artifact carried, torch looks up in the store itself.

Torch is pointed at `inductor/` only for the length of the pack's own compiled calls (TORCHINDUCTOR_CACHE_DIR,
restored afterwards), so compiles made by anything else in the process keep torch's default. The artifacts are
what export/import moves between machines and what rebuilds `inductor/` after an eviction; each file carries a
checksum, so a corrupt or truncated one is skipped (and deleted) instead of reaching torch.

Each job is a module of its own, and EnvironmentCache hands each call to the part that does it:
    files.py             atomic owner-only writes, the checksummed artifact format
    torch_scope.py       torch's caches pointed at `inductor/` for one call; setting damaged torch files aside
    artifacts.py         saving and loading a compile key's Mega-Cache artifacts
    precompiled_files.py a compile key's precompiled functions
    remote_mirror.py     filling the directory from the remote store, publishing to it
    eviction.py          the size cap
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from .artifacts import Artifacts
from .eviction import DEFAULT_MAX_GB, EVICT_EVERY_S, MAX_SIZE_ENV, Eviction
from .files import (ARTIFACT_NAME, MAGIC, NO_ROOM, NO_ROOM_TEXTS, out_of_room, pack_artifact, read_header, tree_size,
                    unpack_artifact, write_atomic)
from .location import cache_root, environment_dirs, environment_id, fingerprint, read_fingerprint
from .precompiled_files import PRECOMPILED_DIR, PRECOMPILED_SUFFIX, PrecompiledFiles
from .remote import remote_store
from .remote_mirror import RemoteMirror
from .torch_scope import ONE_SCOPE_AT_A_TIME, TorchScope, torch_caches_on_the_store
from .trust import FIX, first_untrusted, make_private_dirs

# The names the rest of the pack (and its tests) import from here, whichever part now holds them.
__all__ = ["ARTIFACT_NAME", "COMPILE_CACHE", "DEFAULT_MAX_GB", "EVICT_EVERY_S", "FINDINGS_FILES", "IN_PIECES_FILE",
           "MAGIC", "MAX_SIZE_ENV", "NO_ROOM", "NO_ROOM_TEXTS", "PRECOMPILED_DIR", "PRECOMPILED_SUFFIX", "SHARES_FILE",
           "CacheBusy", "CompileCache", "EnvironmentCache", "clear_disk_cache", "disk_info", "environment_dirs",
           "key_id", "out_of_room", "pack_artifact", "read_fingerprint", "read_header", "torch_caches_on_the_store",
           "tree_size", "unpack_artifact", "write_atomic"]

log = logging.getLogger("comfyui_accel")

SHARES_FILE = "auto_call_shares.json"
IN_PIECES_FILE = "auto_in_pieces.json"
# What auto mode found per kind (compile/saved_findings.py): tables of kind id -> finding, exported with the
# artifacts and merged on import, the target machine's own findings first (portable.py).
FINDINGS_FILES = (SHARES_FILE, IN_PIECES_FILE)


def key_id(key: tuple) -> str:
    """A compile key (a tuple of strings, numbers and None) as a stable file-system name."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:20]


class EnvironmentCache:
    """The cache of one environment (one device type in this process): its directory, whether this process may
    use it, and what its parts counted. The other methods are the names the pack calls, each handed to its part."""

    def __init__(self, root: Path, device_type: str):
        self.fingerprint = fingerprint(device_type)
        self.env_id = environment_id(self.fingerprint)
        self.root = root.resolve()  # a link the user made to a volume: its target is what trust.py checks
        self.dir = self.root / self.env_id
        self.inductor_dir = self.dir / "inductor"
        self.artifacts_dir = self.dir / "artifacts"
        self.usable: bool | None = None  # checked at first use
        self.problem = ""
        # One lock for all parts: a load fills from the store and may stop persisting, all under it.
        self.lock = threading.RLock()
        self.stats = {"artifacts_loaded": 0, "artifacts_saved": 0, "artifacts_skipped_corrupt": 0,
                      "artifacts_not_loaded": 0,  # kept: a read or torch's write failed, not the file
                      "artifacts_skipped_untrusted": 0, "evicted": 0, "torch_files_set_aside": 0,
                      "artifacts_from_remote": 0, "precompiled_saved": 0, "precompiled_from_remote": 0}
        self.scope = TorchScope(self)
        self.artifacts = Artifacts(self)
        self.precompiled = PrecompiledFiles(self)
        self.mirror = RemoteMirror(self)
        self.eviction = Eviction(self)

    # -- whether the directory can be used ------------------------------------------------------------
    def check_usable(self) -> bool:
        """Whether this environment's directory can be used: private to this user (trust.py) and writable.
        Checked once per process; the answer and its reason are in the stats."""
        if self.usable is None:
            with self.lock:
                try:
                    ours = [self.root, self.dir, self.inductor_dir, self.artifacts_dir]
                    why = first_untrusted(ours)  # before anything is made in it: a refused cache is left alone
                    if not why:
                        for path in (self.inductor_dir, self.artifacts_dir):
                            make_private_dirs(path)
                        why = first_untrusted(ours)  # what was just made, or appeared meanwhile
                    if why:
                        self.usable, self.problem = False, f"not trusted: {why}"
                        log.warning("[Accel] compile cache: not used, %s. %s Compiling still works, on torch's "
                                    "temporary cache (nothing persists across restarts).", why, FIX)
                        return False
                    for path in (self.inductor_dir, self.artifacts_dir):
                        with tempfile.TemporaryFile(dir=path):
                            pass
                    if read_fingerprint(self.dir) is None:  # new, or damaged: what `cache info` shows
                        write_atomic(self.dir / "fingerprint.json", json.dumps(self.fingerprint, indent=1).encode())
                    self.usable = True
                except OSError as err:
                    self.usable = False
                    self.problem = f"{type(err).__name__}: {err}"
                    log.warning("[Accel] compile cache: cannot write to %s (%s). Compiling still works, but compiled "
                                "graphs go to torch's temporary cache and will not survive a restart; set "
                                "ACCEL_CACHE_DIR to a writable directory.", self.dir, self.problem)
        return self.usable

    def keep_fingerprint(self) -> None:
        """fingerprint.json again after a save, where `cache clear` in another process removed this environment
        meanwhile: without it `cache info`, export and clear passed over the folder this process fills again,
        until it restarted."""
        path = self.dir / "fingerprint.json"
        if not path.exists():
            write_atomic(path, json.dumps(self.fingerprint, indent=1).encode())

    def stop_persisting(self, why: str) -> None:
        """The disk under this cache ran out of room during a compile: the rest of this process compiles in torch's
        temporary cache, and what the cache holds stays as it is, for the processes after this one. Warned once."""
        with self.lock:
            if self.usable is False:
                return
            self.usable, self.problem = False, f"out of room: {why}"
        log.warning("[Accel] compile cache: %s is out of room (%s). Compiling goes on in torch's temporary cache, so "
                    "what compiles now will not survive a restart; free some space, or set ACCEL_CACHE_DIR to a disk "
                    "with room (ACCEL_CACHE_MAX_GB caps the cache's size).", self.dir, why)

    def describe(self) -> dict:
        keys = [p for p in self.artifacts_dir.glob("*") if p.is_dir()] if self.artifacts_dir.is_dir() else []
        remote = remote_store()
        return {"dir": str(self.dir), "env_id": self.env_id, "fingerprint": self.fingerprint,
                "writable": self.usable, "problem": self.problem, "keys": len(keys), **self.stats,
                "remote": None if remote is None else remote.describe()}

    # -- the names the pack calls, each handed to its part --------------------------------------------
    def compiling(self, ident: str, label: str) -> contextlib.AbstractContextManager[None]:
        return self.scope.compiling(ident, label)  # torch_scope.py

    def loading(self) -> contextlib.AbstractContextManager[None]:
        return self.scope.loading()

    def set_aside_torch_files(self, label: str, why: str) -> None:
        self.scope.set_aside_torch_files(label, why)

    def has_artifacts(self, ident: str) -> bool:
        return self.artifacts.has(ident)  # artifacts.py

    def load_file(self, path: Path) -> bool:
        return self.artifacts.load_file(path)

    def has_precompiled(self, ident: str, loadable: Callable[[dict], bool]) -> bool:
        return self.precompiled.has(ident, loadable)  # precompiled_files.py

    def precompiled_files(self, ident: str) -> list[tuple[dict, bytes]]:
        return self.precompiled.files(ident)

    def save_precompiled(self, ident: str, name: str, payload: bytes, label: str, meta: dict) -> None:
        self.precompiled.save(ident, name, payload, label, meta)

    def evict_if_needed(self, force: bool = False) -> None:
        self.eviction.evict_if_needed(force)  # eviction.py


class CompileCache:
    """The process's view of the cache: one EnvironmentCache per device type, under the root resolved at first
    use (ComfyUI's base directory is known only once ComfyUI is imported)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._envs: dict[tuple[str, str], EnvironmentCache] = {}

    def environment(self, device_type: str) -> EnvironmentCache:
        root = cache_root()
        with self._lock:
            found = self._envs.get((str(root), device_type))
            if found is None:
                found = self._envs[(str(root), device_type)] = EnvironmentCache(root, device_type)
            return found

    def forget_environments(self) -> None:
        """After the directories were deleted: the next use of each environment checks and recreates them."""
        with self._lock:
            self._envs.clear()

    def stats(self) -> dict:
        with self._lock:
            envs = list(self._envs.values())
        return {"root": str(cache_root()), "environments": [env.describe() for env in envs]}


COMPILE_CACHE = CompileCache()


class CacheBusy(RuntimeError):
    """The cache is in use by a compile of this process and cannot be cleared now."""


def disk_info(root: Path) -> dict:
    """What the cache holds on disk: each environment's fingerprint, compile keys and size (`cache info`, the
    web UI's panel). A damaged fingerprint is said, not raised: the panel's Clear button comes with this answer."""
    unreadable = {"unreadable": "fingerprint.json is damaged; the next compile in this environment writes it again"}
    return {"root": str(root), "environments": [
        {"env_id": p.name, "fingerprint": read_fingerprint(p) or unreadable,
         "keys": len([k for k in (p / "artifacts").glob("*") if k.is_dir()]),
         "megabytes": round(tree_size(p) / 2**20, 1)} for p in environment_dirs(root)]}


def clear_disk_cache(root: Path) -> dict:
    """Delete every environment in the cache root, and the root when nothing else is left in it, as `python -m
    accel cache clear` does. Graphs this process already holds keep working; the next compile of anything starts
    afresh and recreates the directories. Refused (CacheBusy) while one of this process's compiles is in its cache
    scope; the caller checks for background work. What is not the pack's in the root stays.
    """
    if not ONE_SCOPE_AT_A_TIME.acquire(blocking=False):
        raise CacheBusy("a compile is writing to the cache right now")
    try:
        removed = 0
        for env_dir in environment_dirs(root):
            removed += tree_size(env_dir)
            shutil.rmtree(env_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when empty
        COMPILE_CACHE.forget_environments()
    finally:
        ONE_SCOPE_AT_A_TIME.release()
    log.info("[Accel] compile cache: removed %s (%.1f MB)", root, removed / 2**20)
    return {"root": str(root), "removed_megabytes": round(removed / 2**20, 1)}
