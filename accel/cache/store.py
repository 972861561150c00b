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
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from ..env_settings import env_float
from .location import cache_root, environment_id, fingerprint
from .remote import remote_store
from .trust import FIX, first_untrusted, make_private_dirs, untrusted

log = logging.getLogger("comfyui_accel")

MAX_SIZE_ENV = "ACCEL_CACHE_MAX_GB"
DEFAULT_MAX_GB = 10.0
MAGIC = b"ACCEL-MEGA-CACHE 1\n"
ARTIFACT_NAME = re.compile(r"[0-9a-f]{20}\.bin")  # what _save names a file
PRECOMPILED_DIR = "precompiled"  # inside a key's folder: its precompiled functions (compile/precompiled.py)
PRECOMPILED_SUFFIX = "-precompiled"  # a key's precompiled functions in the remote store: their own key id
SHARES_FILE = "auto_call_shares.json"
IN_PIECES_FILE = "auto_in_pieces.json"
# What auto mode found per kind (compile/saved_findings.py): tables of kind id -> finding, exported with the
# artifacts and merged on import, the target machine's own findings first (portable.py).
FINDINGS_FILES = (SHARES_FILE, IN_PIECES_FILE)
EVICT_EVERY_S = 30.0  # sizing a cache walks its files: at most this often per process
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NO_ROOM_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


def key_id(key: tuple) -> str:
    """A compile key (a tuple of strings, numbers and None) as a stable file-system name."""
    return hashlib.sha256(repr(key).encode()).hexdigest()[:20]


def write_atomic(path: Path, data: bytes) -> None:
    """Readers see the old file or the whole new one, never a partial write (a crash leaves a stray tmp file).
    The file is owner-only (mkstemp's 0600), and so are the directories made for it (trust.py)."""
    make_private_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def out_of_room(err: BaseException) -> bool:
    """Whether `err`, or what it wraps (Dynamo wraps a backend's errors), is a write that found its disk full. A C++
    compiler that could not write its output says so only in its message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in NO_ROOM:
            return True
        if any(text in str(err) for text in NO_ROOM_TEXTS):
            return True
        err = getattr(err, "inner_exception", None) or err.__cause__ or err.__context__
    return False


def pack_artifact(payload: bytes, label: str, meta: dict | None = None) -> bytes:
    header = {"label": label, "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), **(meta or {})}
    return MAGIC + json.dumps(header).encode() + b"\n" + payload


def read_header(path: Path) -> dict | None:
    """An artifact file's header alone (its first lines, not the payload); None when it has none."""
    try:
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return None
            return json.loads(f.readline())
    except (OSError, ValueError):
        return None


def unpack_artifact(data: bytes) -> tuple[dict, bytes]:
    """The header and payload of an artifact file; ValueError naming what is wrong when it is damaged."""
    if not data.startswith(MAGIC):
        raise ValueError("not an Accel artifact file (bad header)")
    header_line, _, payload = data[len(MAGIC):].partition(b"\n")
    header = json.loads(header_line)
    if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise ValueError(f"truncated or corrupt ({len(payload)} of {header['size']} bytes, checksum mismatch)")
    return header, payload


def tree_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


@contextlib.contextmanager
def _scoped_env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


_ONE_SCOPE_AT_A_TIME = threading.RLock()


@contextlib.contextmanager
def torch_caches_on_the_store(env_id: str) -> Iterator[None]:
    """With a remote store: torch's own FX graph and AOTAutograd remote caches on, pointed at the store's
    verifying endpoint (torch_remote.py), for this one scope."""
    remote = remote_store()
    endpoint = None if remote is None else remote.torch_endpoint()
    if endpoint is None:
        yield
        return
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with endpoint.serving(env_id), _scoped_env("TORCHINDUCTOR_REDIS_URL", endpoint.url), \
            inductor_config.patch(fx_graph_remote_cache=True), \
            functorch_config.patch(enable_remote_autograd_cache=True):
        yield


@contextlib.contextmanager
def _own_artifact_record() -> Iterator[object | None]:
    """torch's Mega-Cache record, fresh for this block: what it compiles or hits is recorded apart from the rest
    of the process (whose own save_cache_artifacts() is left as it was). None where torch has no Mega-Cache."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        yield None
        return
    with CacheArtifactManager.with_fresh_cache():
        yield CacheArtifactManager


class EnvironmentCache:
    """The cache of one environment (one device type in this process)."""

    def __init__(self, root: Path, device_type: str):
        self.fingerprint = fingerprint(device_type)
        self.env_id = environment_id(self.fingerprint)
        self.root = root.resolve()  # a link the user made to a volume: its target is what trust.py checks
        self.dir = self.root / self.env_id
        self.inductor_dir = self.dir / "inductor"
        self.artifacts_dir = self.dir / "artifacts"
        self.usable: bool | None = None  # checked at first use
        self.problem = ""
        self._loaded: set[str] = set()
        self._asked_remote: set[str] = set()  # compile keys looked up in the remote store by this process
        self._lock = threading.RLock()
        self._last_evict = 0.0
        self.stats = {"artifacts_loaded": 0, "artifacts_saved": 0, "artifacts_skipped_corrupt": 0,
                      "artifacts_not_loaded": 0,  # kept: a read or torch's write failed, not the file
                      "artifacts_skipped_untrusted": 0, "evicted": 0, "torch_files_set_aside": 0,
                      "artifacts_from_remote": 0, "precompiled_saved": 0, "precompiled_from_remote": 0}

    # -- the scope of one compiled call ---------------------------------------------------------------
    @contextlib.contextmanager
    def compiling(self, ident: str, label: str) -> Iterator[None]:
        """Wrap one of the pack's compiled calls: torch's caches read and write this environment's directory and
        whatever the call compiles is saved as the artifacts of compile key `ident` (see key_id). One such call
        at a time in the process: the scope sets a process-wide variable and torch's process-wide artifact
        record (and `loading` the same variable)."""
        if not self.check_usable():
            yield
            return
        with _ONE_SCOPE_AT_A_TIME:
            self._load(ident)
            with _scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.inductor_dir)), \
                    torch_caches_on_the_store(self.env_id), _own_artifact_record() as record:
                from torch._dynamo.utils import counters

                frames = counters["frames"]["ok"]
                yield
                if record is not None and counters["frames"]["ok"] != frames:
                    self._save(ident, label, record)

    def check_usable(self) -> bool:
        """Whether this environment's directory can be used: private to this user (trust.py) and writable.
        Checked once per process; the answer and its reason are in the stats."""
        if self.usable is None:
            with self._lock:
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

    def _keep_fingerprint(self) -> None:
        """fingerprint.json again after a save, where `cache clear` in another process removed this environment
        meanwhile: without it `cache info`, export and clear passed over the folder this process fills again,
        until it restarted."""
        path = self.dir / "fingerprint.json"
        if not path.exists():
            write_atomic(path, json.dumps(self.fingerprint, indent=1).encode())

    def stop_persisting(self, why: str) -> None:
        """The disk under this cache ran out of room during a compile: the rest of this process compiles in torch's
        temporary cache, and what the cache holds stays as it is, for the processes after this one. Warned once."""
        with self._lock:
            if self.usable is False:
                return
            self.usable, self.problem = False, f"out of room: {why}"
        log.warning("[Accel] compile cache: %s is out of room (%s). Compiling goes on in torch's temporary cache, so "
                    "what compiles now will not survive a restart; free some space, or set ACCEL_CACHE_DIR to a disk "
                    "with room (ACCEL_CACHE_MAX_GB caps the cache's size).", self.dir, why)

    def set_aside_torch_files(self, label: str, why: str) -> None:
        """A compile inside this cache failed where the same compile outside it worked: torch's own files here are
        damaged (torch checks none of its generated code and kernels). `inductor/` is moved aside and deleted; the
        pack's artifacts, which carry checksums, rebuild it at each compile key's next use in a process, and new
        compiles write there again. Another process writing into the old folder meanwhile loses that write and
        compiles again, as this one did."""
        with _ONE_SCOPE_AT_A_TIME, self._lock:  # no compile of this process writes there meanwhile
            aside = self.dir / f".inductor-damaged-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.rename(self.inductor_dir, aside)
                make_private_dirs(self.inductor_dir)
            except OSError as err:
                self.stop_persisting(f"{type(err).__name__}: {err}")
                return
            shutil.rmtree(aside, ignore_errors=True)
            self._loaded.clear()  # each key's artifacts are handed to torch again at its next compile
            self.stats["torch_files_set_aside"] += 1
        log.warning("[Accel] compile cache: torch's files in %s failed to load for %s (%s), and the same compile "
                    "outside the cache worked: they were damaged, and are rebuilt from the pack's artifacts and new "
                    "compiles. `python -m accel cache clear` starts the cache afresh.", self.inductor_dir, label, why)

    def has_artifacts(self, ident: str) -> bool:
        """Whether compile key `ident` has saved artifacts here (from this machine, precompile, an import, or the
        remote store, which is asked once per process when there are none)."""
        if any((self.artifacts_dir / ident).glob("*.bin")):
            return True
        self._fill_from_remote(ident)
        return any((self.artifacts_dir / ident).glob("*.bin"))

    def _fill_from_remote(self, ident: str, precompiled: bool = False) -> None:
        """Once per process and key: the remote store's verified artifacts of `ident` (with `precompiled`, its
        precompiled functions) that this directory lacks are written into it (the store's own checks are in
        remote.py; a file is then loaded as a local one)."""
        remote = remote_store()
        asked = ident + PRECOMPILED_SUFFIX if precompiled else ident  # their key in the store
        with self._lock:
            if remote is None or asked in self._asked_remote or not self.check_usable():
                return
            self._asked_remote.add(asked)
        folder = self.artifacts_dir / ident / (PRECOMPILED_DIR if precompiled else "")
        have = {path.name for path in folder.glob("*.bin")}
        for name, data in remote.fetch(self.env_id, asked, have).items():
            if not ARTIFACT_NAME.fullmatch(name):  # signed, but never a path out of the key's folder
                continue
            try:
                write_atomic(folder / name, data)
            except OSError as err:
                log.warning("[Accel] compile cache: could not write %s from the remote store (%s); it is compiled "
                            "here instead.", folder / name, err)
                return
            self.stats["precompiled_from_remote" if precompiled else "artifacts_from_remote"] += 1

    # -- artifacts ------------------------------------------------------------------------------------
    def _load(self, ident: str) -> None:
        """Once per process and key: hand this key's artifacts to torch, which writes them into `inductor/`
        (a no-op in effect when they are already there; the rebuild after an eviction or an import)."""
        if ident in self._loaded:
            return
        with self._lock:
            if ident in self._loaded:
                return
            self._loaded.add(ident)
            self._fill_from_remote(ident)
            key_dir = self.artifacts_dir / ident
            why = untrusted(key_dir, directory=True)
            if why:
                log.warning("[Accel] compile cache: not loading %s, %s. %s", key_dir, why, FIX)
                return
            for path in sorted(key_dir.glob("*.bin")):
                self.load_file(path)
            if key_dir.is_dir():
                _touch(key_dir / "last_used")

    def load_file(self, path: Path) -> bool:
        import torch

        why = untrusted(path, directory=False)
        if why:  # left where it is: it may not be this user's to delete
            self.stats["artifacts_skipped_untrusted"] += 1
            log.warning("[Accel] compile cache: not loading %s, %s. %s", path, why, FIX)
            return False
        try:
            _, payload = unpack_artifact(path.read_bytes())
            with _scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.inductor_dir)):
                if torch.compiler.load_cache_artifacts(payload) is None:
                    raise ValueError("torch could not read it")
        except OSError as err:
            # Reading it or writing torch's caches from it failed (a full disk, permissions, I/O), not the file:
            # it stays for the processes after this one, and this one compiles the key afresh.
            self.stats["artifacts_not_loaded"] += 1
            if out_of_room(err):
                self.stop_persisting(f"{type(err).__name__}: {err}")
            log.warning("[Accel] compile cache: could not load %s (%s); it is kept, and its graphs are compiled "
                        "again in this process.", path, err)
            return False
        except Exception as err:  # a damaged entry costs a recompile, never the prompt
            self.stats["artifacts_skipped_corrupt"] += 1
            log.warning("[Accel] compile cache: skipping %s (%s); it is deleted and will be rebuilt by the next "
                        "compile.", path, err)
            with contextlib.suppress(OSError):
                path.unlink()
            return False
        self.stats["artifacts_loaded"] += 1
        return True

    def _save(self, ident: str, label: str, record) -> None:
        try:
            serialized = record.serialize()
            if serialized is None:
                return
            payload, info = serialized
            # Named by the artifacts' own cache keys (the bytes differ from one process to the next), so the
            # same compile hit again in another process is recognised as already saved.
            keys = sorted(f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys)
            name = hashlib.sha256(repr(keys).encode()).hexdigest()[:20] + ".bin"
            key_dir = self.artifacts_dir / ident
            data = pack_artifact(payload, label)
            if not (key_dir / name).exists():
                write_atomic(key_dir / name, data)
                self.stats["artifacts_saved"] += 1
                self._keep_fingerprint()
            _touch(key_dir / "last_used")
        except OSError as err:
            log.warning("[Accel] compile cache: could not save the artifacts of %s (%s); the next process will "
                        "compile it again.", label, err)
            return
        remote = remote_store()
        if remote is not None:  # also what was here already: a cache older than the store fills it too
            remote.publish(self.env_id, self.fingerprint, ident, name, data, label)
        self.evict_if_needed()

    # -- precompiled functions (compile/precompiled.py) -------------------------------------------------
    def has_precompiled(self, ident: str, loadable: Callable[[dict], bool]) -> bool:
        """Whether compile key `ident` has a precompiled function here whose header is `loadable` (or, asked once
        per process, in the remote store, whose verified files are then written here). A file this pack cannot
        load (another format) does not count: the kind then goes to a child as if it had none, rather than load
        through Dynamo in a prompt."""
        folder = self.artifacts_dir / ident / PRECOMPILED_DIR

        def found() -> bool:
            return any(loadable(header) for header in map(read_header, folder.glob("*.bin")) if header)

        if not found():
            self._fill_from_remote(ident, precompiled=True)
        return found()

    def precompiled_files(self, ident: str) -> list[tuple[dict, bytes]]:
        """(header, payload) of each precompiled function of `ident` that verifies: its folder and file owner-only
        (trust.py: they are code), its checksum intact. A damaged file is deleted (the next child makes it again),
        an untrusted one left where it is, each with a warning."""
        if not self.check_usable():
            return []
        folder = self.artifacts_dir / ident / PRECOMPILED_DIR
        why = untrusted(folder, directory=True) if folder.exists() else ""
        if why:
            log.warning("[Accel] compile cache: not loading %s, %s. %s", folder, why, FIX)
            return []
        found = []
        for path in sorted(folder.glob("*.bin")):
            why = untrusted(path, directory=False)
            if why:
                self.stats["artifacts_skipped_untrusted"] += 1
                log.warning("[Accel] compile cache: not loading %s, %s. %s", path, why, FIX)
                continue
            try:
                found.append(unpack_artifact(path.read_bytes()))
            except OSError as err:  # not the file's fault (permissions, I/O): it stays for the next process
                self.stats["artifacts_not_loaded"] += 1
                log.warning("[Accel] compile cache: could not read %s (%s); it is kept.", path, err)
            except ValueError as err:
                self.stats["artifacts_skipped_corrupt"] += 1
                log.warning("[Accel] compile cache: skipping %s (%s); it is deleted and made again by the next "
                            "background compile.", path, err)
                with contextlib.suppress(OSError):
                    path.unlink()
        _touch(self.artifacts_dir / ident / "last_used")
        return found

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Loading precompiled functions: torch's caches in this environment's directory, where the child left the
        compiled kernels (elsewhere torch would build them again: seconds)."""
        if not self.check_usable():
            yield
            return
        with _ONE_SCOPE_AT_A_TIME, _scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.inductor_dir)):
            yield

    def save_precompiled(self, ident: str, name: str, payload: bytes, label: str, meta: dict) -> None:
        """Keep one precompiled function of `ident` (`name`: 20 hex digits) here and, with a store, publish it."""
        data = pack_artifact(payload, label, meta)
        path = self.artifacts_dir / ident / PRECOMPILED_DIR / f"{name}.bin"
        try:
            if not path.exists():
                write_atomic(path, data)
                self.stats["precompiled_saved"] += 1
                self._keep_fingerprint()
        except OSError as err:
            log.warning("[Accel] compile cache: could not save a precompiled function of %s (%s); the next process "
                        "loads it through Dynamo instead.", label, err)
            return
        remote = remote_store()
        if remote is not None:
            remote.publish(self.env_id, self.fingerprint, ident + PRECOMPILED_SUFFIX, path.name, data, label)

    # -- size cap ---------------------------------------------------------------------------------------
    def evict_if_needed(self, force: bool = False) -> None:
        """Keep the whole cache root under ACCEL_CACHE_MAX_GB, least recently used first: other environments'
        directories, then this environment's compile keys not used by this process."""
        now = time.monotonic()
        if not force and now - self._last_evict < EVICT_EVERY_S:
            return
        self._last_evict = now
        cap_gb = env_float(MAX_SIZE_ENV, DEFAULT_MAX_GB, allow_inf=True)
        if cap_gb == math.inf:  # no cap
            return
        cap = int(cap_gb * 2**30)
        sizes = {path: tree_size(path) for path in {*environment_dirs(self.dir.parent), self.dir}}
        total = sum(sizes.values())
        if total <= cap:
            return
        candidates = [(_environment_last_used(path), path, size) for path, size in sizes.items() if path != self.dir]
        for key_dir in self.artifacts_dir.iterdir():
            if key_dir.is_dir() and key_dir.name not in self._loaded:
                candidates.append((_last_used(key_dir), key_dir, tree_size(key_dir)))
        for _, path, size in sorted(candidates, key=lambda c: c[0]):
            if total <= cap:
                break
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            self.stats["evicted"] += 1
            log.info("[Accel] compile cache: evicted %s (%.1f MB, least recently used) to stay under %s GB",
                     path, size / 2**20, cap / 2**30)
        if total > cap:
            # torch's working cache alone is over the cap: start it afresh; the artifacts rebuild it on demand
            shutil.rmtree(self.inductor_dir, ignore_errors=True)
            make_private_dirs(self.inductor_dir)
            self._loaded.clear()
            self.stats["evicted"] += 1

    def describe(self) -> dict:
        keys = [p for p in self.artifacts_dir.glob("*") if p.is_dir()] if self.artifacts_dir.is_dir() else []
        remote = remote_store()
        return {"dir": str(self.dir), "env_id": self.env_id, "fingerprint": self.fingerprint,
                "writable": self.usable, "problem": self.problem, "keys": len(keys), **self.stats,
                "remote": None if remote is None else remote.describe()}


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.touch()


def _last_used(path: Path) -> float:
    for candidate in (path / "last_used", path):
        with contextlib.suppress(OSError):
            return candidate.stat().st_mtime
    return 0.0


def _environment_last_used(env_dir: Path) -> float:
    """An environment's last use: its compile keys' (each load or save touches the key's), or the folder's own
    time. The folder's time alone barely changes while workers use it on a shared volume."""
    keys = env_dir / "artifacts"
    found = [_last_used(key) for key in keys.iterdir() if key.is_dir()] if keys.is_dir() else []
    return max([_last_used(env_dir), *found])


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


def environment_dirs(root: Path) -> list[Path]:
    """The pack's environment directories under `root`: each holds its fingerprint.json. Nothing else there is
    the pack's to count, evict or clear: ACCEL_CACHE_DIR may name a folder that holds other things too (a shared
    volume's root, ~/.cache)."""
    return sorted(p for p in root.iterdir() if (p / "fingerprint.json").is_file()) if root.is_dir() else []


def read_fingerprint(env_dir: Path) -> dict | None:
    """An environment's fingerprint.json; None when it cannot be read (missing, damaged). It only describes the
    environment (its folder's name is the id), so a damaged one costs nothing but its description: the next
    process to use the environment writes it again."""
    try:
        found = json.loads((env_dir / "fingerprint.json").read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


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
    if not _ONE_SCOPE_AT_A_TIME.acquire(blocking=False):
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
        _ONE_SCOPE_AT_A_TIME.release()
    log.info("[Accel] compile cache: removed %s (%.1f MB)", root, removed / 2**20)
    return {"root": str(root), "removed_megabytes": round(removed / 2**20, 1)}
