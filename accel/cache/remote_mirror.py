"""What one environment's directory (store.py) shares with the fleet's remote store (remote.py), when
ACCEL_REMOTE_CACHE names one: the directory stays the first level; the store fills what it lacks, and what is
saved here is published there."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .files import ARTIFACT_NAME, write_atomic
from .precompiled_files import PRECOMPILED_DIR, PRECOMPILED_SUFFIX
from .remote import remote_store

if TYPE_CHECKING:
    from .store import EnvironmentCache

log = logging.getLogger("comfyui_accel")


class RemoteMirror:
    """Fill one environment's directory from the remote store, and publish to it what is saved here."""

    def __init__(self, env: EnvironmentCache):
        self.env = env
        self.asked: set[str] = set()  # compile keys looked up in the remote store by this process

    def fill(self, ident: str, precompiled: bool = False) -> None:
        """Once per process and key: the remote store's verified artifacts of `ident` (with `precompiled`, its
        precompiled functions) that this directory lacks are written into it (the store's own checks are in
        remote.py; a file is then loaded as a local one)."""
        env = self.env
        remote = remote_store()
        asked = ident + PRECOMPILED_SUFFIX if precompiled else ident  # their key in the store
        with env.lock:
            if remote is None or asked in self.asked or not env.check_usable():
                return
            self.asked.add(asked)
        folder = env.artifacts_dir / ident / (PRECOMPILED_DIR if precompiled else "")
        have = {path.name for path in folder.glob("*.bin")}
        for name, data in remote.fetch(env.env_id, asked, have).items():
            if not ARTIFACT_NAME.fullmatch(name):  # signed, but never a path out of the key's folder
                continue
            try:
                write_atomic(folder / name, data)
            except OSError as err:
                log.warning("[Accel] compile cache: could not write %s from the remote store (%s); it is compiled "
                            "here instead.", folder / name, err)
                return
            env.stats["precompiled_from_remote" if precompiled else "artifacts_from_remote"] += 1

    def publish(self, ident: str, name: str, data: bytes, label: str) -> None:
        """With a store: one file saved here under store key `ident` (a precompiled function's: PRECOMPILED_SUFFIX
        added), also there."""
        remote = remote_store()
        if remote is not None:
            remote.publish(self.env.env_id, self.env.fingerprint, ident, name, data, label)
