"""The compile cache holds code, so it is kept private and checked before anything in it is used.

torch loads compiled kernels (shared libraries) and unpickles graphs from the cache's `inductor/` and artifacts,
and the background child unpickles its jobs from it: whoever can write into it can run code in every ComfyUI
process that uses it. So the pack creates the cache's directories owner-only (0700; files are written 0600 by
store.write_atomic; torch's own `inductor/` tree below them gets the user's umask, private in effect behind the
0700 root), and before using a directory of it, or loading a file from it, refuses one that another user
owns, that group or others may write to, or that is a symbolic link inside the cache. A refused cache is not used
at all: compiling still works, on torch's own temporary cache, and one warning says what is wrong and the fix.

The cache root itself may be a link the user made (ACCEL_CACHE_DIR on a volume): its target is what is checked.
Where the OS has no POSIX owners and modes (Windows), nothing is checked.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
CHECKED = os.name == "posix"


def make_private_dirs(path: Path) -> None:
    """Create `path` and any missing directory above it, each owner-only (existing ones are left as they are)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            pass


def untrusted(path: Path, directory: bool) -> str | None:
    """Why the pack must not use `path` (a directory of the cache, or a file in it), in words; None when it may.
    A path that does not exist is trusted (nothing can be loaded from it)."""
    if not CHECKED:
        return None
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        return f"{path} is a symbolic link"
    if directory != stat.S_ISDIR(found.st_mode):
        return f"{path} is not a {'directory' if directory else 'regular file'}"
    if found.st_uid != os.geteuid():
        return f"{path} is owned by uid {found.st_uid}, not by this process's user (uid {os.geteuid()})"
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(found.st_mode):o})"
    return None


def first_untrusted(directories: list[Path]) -> str | None:
    for path in directories:
        why = untrusted(path, directory=True)
        if why:
            return why
    return None


FIX = ("A compile cache holds code that ComfyUI runs, so the pack uses only a cache that this user owns and no one "
       "else can write to. Fix it with `chmod -R go-w` and `chown` on that directory, delete it (it is rebuilt), or "
       "set ACCEL_CACHE_DIR to a directory of your own.")
