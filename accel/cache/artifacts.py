"""The Mega-Cache artifacts of one environment's compile keys (store.py's `artifacts/<key>/*.bin`): saved after a
compile, handed to torch once per process and key, which writes them into `inductor/` (the rebuild after an
eviction or an import). Each file carries a checksum, so a corrupt or truncated one is skipped (and deleted)
instead of reaching torch; one that is not this user's is left alone."""
from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from .files import out_of_room, pack_artifact, touch, unpack_artifact, write_atomic
from .torch_scope import scoped_env
from .trust import FIX, untrusted

if TYPE_CHECKING:
    from .store import EnvironmentCache

log = logging.getLogger("comfyui_accel")


class Artifacts:
    """Save, find and load the artifacts of one environment's compile keys."""

    def __init__(self, env: EnvironmentCache):
        self.env = env
        self.loaded: set[str] = set()  # compile keys handed to torch by this process (kept from eviction)

    def forget_loaded(self) -> None:
        """`inductor/` was started afresh: each key's artifacts are handed to torch again at its next compile."""
        self.loaded.clear()

    def has(self, ident: str) -> bool:
        """Whether compile key `ident` has saved artifacts here (from this machine, precompile, an import, or the
        remote store, which is asked once per process when there are none)."""
        if any((self.env.artifacts_dir / ident).glob("*.bin")):
            return True
        self.env.mirror.fill(ident)
        return any((self.env.artifacts_dir / ident).glob("*.bin"))

    def load(self, ident: str) -> None:
        """Once per process and key: hand this key's artifacts to torch, which writes them into `inductor/`
        (a no-op in effect when they are already there; the rebuild after an eviction or an import)."""
        if ident in self.loaded:
            return
        with self.env.lock:
            if ident in self.loaded:
                return
            self.loaded.add(ident)
            self.env.mirror.fill(ident)
            key_dir = self.env.artifacts_dir / ident
            why = untrusted(key_dir, directory=True)
            if why:
                log.warning("[Accel] compile cache: not loading %s, %s. %s", key_dir, why, FIX)
                return
            for path in sorted(key_dir.glob("*.bin")):
                self.load_file(path)
            if key_dir.is_dir():
                touch(key_dir / "last_used")

    def load_file(self, path: Path) -> bool:
        import torch

        stats = self.env.stats
        why = untrusted(path, directory=False)
        if why:  # left where it is: it may not be this user's to delete
            stats["artifacts_skipped_untrusted"] += 1
            log.warning("[Accel] compile cache: not loading %s, %s. %s", path, why, FIX)
            return False
        try:
            _, payload = unpack_artifact(path.read_bytes())
            with scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.env.inductor_dir)):
                if torch.compiler.load_cache_artifacts(payload) is None:
                    raise ValueError("torch could not read it")
        except OSError as err:
            # Reading it or writing torch's caches from it failed (a full disk, permissions, I/O), not the file:
            # it stays for the processes after this one, and this one compiles the key afresh.
            stats["artifacts_not_loaded"] += 1
            if out_of_room(err):
                self.env.stop_persisting(f"{type(err).__name__}: {err}")
            log.warning("[Accel] compile cache: could not load %s (%s); it is kept, and its graphs are compiled "
                        "again in this process.", path, err)
            return False
        except Exception as err:  # a damaged entry costs a recompile, never the prompt
            stats["artifacts_skipped_corrupt"] += 1
            log.warning("[Accel] compile cache: skipping %s (%s); it is deleted and will be rebuilt by the next "
                        "compile.", path, err)
            with contextlib.suppress(OSError):
                path.unlink()
            return False
        stats["artifacts_loaded"] += 1
        return True

    def save(self, ident: str, label: str, record) -> None:
        """What torch's artifact record holds after a compile of `ident`, as one file here and, with a store, there;
        then the cache is kept under its size cap."""
        try:
            serialized = record.serialize()
            if serialized is None:
                return
            payload, info = serialized
            # Named by the artifacts' own cache keys (the bytes differ from one process to the next), so the
            # same compile hit again in another process is recognised as already saved.
            keys = sorted(f"{kind}:{key}" for kind, keys in info.artifacts.items() for key in keys)
            name = hashlib.sha256(repr(keys).encode()).hexdigest()[:20] + ".bin"
            key_dir = self.env.artifacts_dir / ident
            data = pack_artifact(payload, label)
            if not (key_dir / name).exists():
                write_atomic(key_dir / name, data)
                self.env.stats["artifacts_saved"] += 1
                self.env.keep_fingerprint()
            touch(key_dir / "last_used")
        except OSError as err:
            log.warning("[Accel] compile cache: could not save the artifacts of %s (%s); the next process will "
                        "compile it again.", label, err)
            return
        # also what was here already: a cache older than the store fills it too
        self.env.mirror.publish(ident, name, data, label)
        self.env.eviction.evict_if_needed()
