"""torch's own remote caches (FX graph, AOTAutograd) on the fleet's store, with reads that verify (#17).

torch's FX graph and AOTAutograd caches can live in a Redis (inductor's `fx_graph_remote_cache`, functorch's
`enable_remote_autograd_cache`, the server named by TORCHINDUCTOR_REDIS_URL), but their reads check nothing: a
pickled compiled graph found under a key is loaded as it is, so whoever can write to that Redis runs code in
every worker. So torch's client is never pointed at the store itself. It talks to this endpoint: a small
Redis-speaking server of the worker's own, on a Unix socket in an owner-only directory (no other user of the
machine can connect, so nobody else can have a write signed). The endpoint signs what torch writes and hands
torch only what verifies (RemoteStore.torch_get / torch_put); an entry that does not verify is a miss, warned.
Only what torch's Redis client sends is served: GET, SET, and the client's connection handshake. The socket's
folder goes with the process at its exit; the folders of killed processes are swept by the next endpoint.

The pack turns torch's caches on and points them here only for the length of its own compiled calls
(store.torch_caches_on_the_store); the endpoint files torch's entries under the environment of the call in
progress (`serving`), so a worker with another torch or GPU misses them, as it misses the pack's artifacts.
AOTAutograd's switch is part of its own cache key: its entries made with a store and without one are apart (a
worker without the store traces AOTAutograd again, and still finds the FX graph).

torch's autotuning remote cache stays off: its switch is written into each generated GPU kernel (inductor_meta),
and the kernel reads the remote cache wherever it is later loaded, a worker without the store or a cache imported
elsewhere included, from whatever Redis torch's own environment variables name there, unverified. Autotuning
results travel in the pack's artifacts (Mega-Cache), the store's first level.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import socketserver
import stat
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator

from ..thread_names import start_thread

if TYPE_CHECKING:
    from .remote import RemoteStore

log = logging.getLogger("comfyui_accel")

MAX_ARGUMENT_BYTES = 512 * 2**20  # a compiled graph of a large model is tens of MB; this bounds a broken client
FOLDER_PREFIX = "accel-torch-cache-"  # the endpoint's socket folder, in the system's temporary folder
SOCKET_NAME = "redis.sock"
# A younger folder may belong to a process between making it and binding its socket: never swept.
STALE_AFTER_S = 60.0


class VerifyingEndpoint:
    """A Redis endpoint for torch's remote caches, in front of the fleet's store (one per store and process)."""

    def __init__(self, store: RemoteStore):
        self.store = store
        sweep_stale_folders()
        self._dir = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # 0700: only this user reaches the socket
        self.path = os.path.join(self._dir, SOCKET_NAME)
        self.url = f"unix://{self.path}"
        self._env_ids: list[str] = []  # the environments of the compiled calls in progress (nested: the last)
        self._lock = threading.Lock()
        endpoint = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                endpoint._serve(self.rfile, self.wfile)

        self._server = socketserver.ThreadingUnixStreamServer(self.path, Handler)
        self._server.daemon_threads = True
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # the socket's directory goes with the process
        start_thread("accel-cache-srv", self._server.serve_forever)

    @contextlib.contextmanager
    def serving(self, env_id: str) -> Iterator[None]:
        """torch's reads and writes meanwhile are this environment's."""
        with self._lock:
            self._env_ids.append(env_id)
        try:
            yield
        finally:
            with self._lock:
                self._env_ids.pop()

    # -- the protocol ------------------------------------------------------------------------------------
    def _serve(self, rfile: BinaryIO, wfile: BinaryIO) -> None:
        connection = {"proto": 2}  # the protocol version this connection's client asked for
        while True:
            try:
                command = _read_command(rfile)
            except (ValueError, OSError) as err:
                log.debug("[Accel] torch cache endpoint: closing a connection (%s)", err)
                return
            if command is None:
                return
            try:
                wfile.write(self._answer(command, connection))
                wfile.flush()
            except OSError:  # the client went away (its process ended mid-answer): nothing to tell it
                return

    def _answer(self, command: list[bytes], connection: dict) -> bytes:
        """Never an error for GET or SET: torch's client treats only a lost connection as the store being down,
        so any other error would reach the compile. A store that fails answers a miss, or drops the write."""
        name = command[0].upper()
        with self._lock:
            env_id = self._env_ids[-1] if self._env_ids else None
        if name == b"GET" and len(command) == 2:
            data = None if env_id is None else self.store.torch_get(env_id, command[1].decode())
            if data is None:
                return b"_\r\n" if connection["proto"] >= 3 else b"$-1\r\n"  # nothing under this key
            return b"$%d\r\n%s\r\n" % (len(data), data)
        if name == b"SET" and len(command) >= 3:
            if env_id is not None:  # a write after the pack's call ended belongs to no environment: dropped
                self.store.torch_put(env_id, command[1].decode(), command[2])
            return b"+OK\r\n"
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"HELLO":  # redis-py's handshake, in the protocol version it asks for (3 since redis-py 6)
            proto = connection["proto"] = int(command[1]) if len(command) > 1 else 2
            fields = b"+server\r\n+accel-endpoint\r\n+proto\r\n:%d\r\n" % proto
            return (b"%2\r\n" if proto >= 3 else b"*4\r\n") + fields
        if name in (b"CLIENT", b"SELECT"):  # the rest of the handshake (library name and version)
            return b"+OK\r\n"
        return b"-ERR the Accel endpoint for torch's caches serves GET and SET only\r\n"


def _read_command(rfile: BinaryIO) -> list[bytes] | None:
    """One command in Redis' wire format (an array of bulk strings); None at the end of the connection."""
    line = rfile.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        raise ValueError("not a Redis command array")
    args = []
    for _ in range(int(line[1:])):
        header = rfile.readline()
        if not header.startswith(b"$"):
            raise ValueError("not a Redis bulk string")
        size = int(header[1:])
        if not 0 <= size <= MAX_ARGUMENT_BYTES:
            raise ValueError(f"an argument of {size} bytes")
        data = rfile.read(size + 2)
        if len(data) != size + 2:
            raise ValueError("the connection ended inside a command")
        args.append(data[:size])
    return args or None


def sweep_stale_folders() -> list[str]:
    """Delete the endpoint folders of this user's processes that are gone: the finalizer that removes a folder
    runs at a normal exit, not when the process is killed (SIGTERM from a service manager, SIGKILL), which left
    one folder in the temporary folder per killed worker. A folder counts as gone when no process listens on its
    socket any more (a pid could be reused; a socket nobody listens on refuses the connection). Folders younger
    than STALE_AFTER_S, other users' and anything else are left. Returns the paths deleted."""
    deleted = []
    for folder in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
        try:
            info = folder.lstat()
        except OSError:
            continue
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or time.time() - info.st_mtime < STALE_AFTER_S or _listened_on(folder / SOCKET_NAME)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        deleted.append(str(folder))
    if deleted:
        log.info("[Accel] compile cache: removed %d socket folders of processes killed before their exit (%s)",
                 len(deleted), tempfile.gettempdir())
    return deleted


def _listened_on(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket `path` (when unsure, as on a timeout: yes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(2.0)
        try:
            client.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def can_serve() -> bool:
    """Unix sockets are what keeps other users of the machine off the endpoint (not on every platform)."""
    return hasattr(socket, "AF_UNIX") and hasattr(socketserver, "ThreadingUnixStreamServer")
