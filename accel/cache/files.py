"""How the compile cache writes and reads its files, shared by its parts (store.py and the modules it is split
into): atomic owner-only writes, the checksummed artifact format, and what a full disk looks like."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from .trust import make_private_dirs

MAGIC = b"ACCEL-MEGA-CACHE 1\n"
ARTIFACT_NAME = re.compile(r"[0-9a-f]{20}\.bin")  # what Artifacts.save names a file (artifacts.py)
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
NO_ROOM_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


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


def touch(path: Path) -> None:
    """A compile key's `last_used` after a load or save (what eviction.py orders by); a failure costs nothing."""
    with contextlib.suppress(OSError):
        path.touch()
