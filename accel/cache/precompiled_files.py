"""torch's AOT precompiled functions of one environment's compile keys (compile/precompiled.py), kept in
`artifacts/<key>/precompiled/*.bin` in the artifact format (files.py) and loaded without Dynamo tracing. They are
code: their folder and each file must be owner-only (trust.py) before they are read."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Callable

from .files import pack_artifact, read_header, touch, unpack_artifact, write_atomic
from .trust import FIX, untrusted

if TYPE_CHECKING:
    from .store import EnvironmentCache

log = logging.getLogger("comfyui_accel")

PRECOMPILED_DIR = "precompiled"  # inside a key's folder: its precompiled functions (compile/precompiled.py)
PRECOMPILED_SUFFIX = "-precompiled"  # a key's precompiled functions in the remote store: their own key id


class PrecompiledFiles:
    """Find, read and save the precompiled functions of one environment's compile keys."""

    def __init__(self, env: EnvironmentCache):
        self.env = env

    def has(self, ident: str, loadable: Callable[[dict], bool]) -> bool:
        """Whether compile key `ident` has a precompiled function here whose header is `loadable` (or, asked once
        per process, in the remote store, whose verified files are then written here). A file this pack cannot
        load (another format) does not count: the kind then goes to a child as if it had none, rather than load
        through Dynamo in a prompt."""
        folder = self.env.artifacts_dir / ident / PRECOMPILED_DIR

        def found() -> bool:
            return any(loadable(header) for header in map(read_header, folder.glob("*.bin")) if header)

        if not found():
            self.env.mirror.fill(ident, precompiled=True)
        return found()

    def files(self, ident: str) -> list[tuple[dict, bytes]]:
        """(header, payload) of each precompiled function of `ident` that verifies: its folder and file owner-only
        (trust.py: they are code), its checksum intact. A damaged file is deleted (the next child makes it again),
        an untrusted one left where it is, each with a warning."""
        env = self.env
        if not env.check_usable():
            return []
        folder = env.artifacts_dir / ident / PRECOMPILED_DIR
        why = untrusted(folder, directory=True) if folder.exists() else ""
        if why:
            log.warning("[Accel] compile cache: not loading %s, %s. %s", folder, why, FIX)
            return []
        found = []
        for path in sorted(folder.glob("*.bin")):
            why = untrusted(path, directory=False)
            if why:
                env.stats["artifacts_skipped_untrusted"] += 1
                log.warning("[Accel] compile cache: not loading %s, %s. %s", path, why, FIX)
                continue
            try:
                found.append(unpack_artifact(path.read_bytes()))
            except OSError as err:  # not the file's fault (permissions, I/O): it stays for the next process
                env.stats["artifacts_not_loaded"] += 1
                log.warning("[Accel] compile cache: could not read %s (%s); it is kept.", path, err)
            except ValueError as err:
                env.stats["artifacts_skipped_corrupt"] += 1
                log.warning("[Accel] compile cache: skipping %s (%s); it is deleted and made again by the next "
                            "background compile.", path, err)
                with contextlib.suppress(OSError):
                    path.unlink()
        touch(env.artifacts_dir / ident / "last_used")
        return found

    def save(self, ident: str, name: str, payload: bytes, label: str, meta: dict) -> None:
        """Keep one precompiled function of `ident` (`name`: 20 hex digits) here and, with a store, publish it."""
        data = pack_artifact(payload, label, meta)
        path = self.env.artifacts_dir / ident / PRECOMPILED_DIR / f"{name}.bin"
        try:
            if not path.exists():
                write_atomic(path, data)
                self.env.stats["precompiled_saved"] += 1
                self.env.keep_fingerprint()
        except OSError as err:
            log.warning("[Accel] compile cache: could not save a precompiled function of %s (%s); the next process "
                        "loads it through Dynamo instead.", label, err)
            return
        self.env.mirror.publish(ident + PRECOMPILED_SUFFIX, path.name, data, label)
