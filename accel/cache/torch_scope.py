"""torch's own caches pointed at one environment's `inductor/` (store.py), for the length of one of the pack's
calls only: TORCHINDUCTOR_CACHE_DIR is set and restored around it, so compiles made by anything else in the
process keep torch's default. One such scope at a time in the process: the variable and torch's artifact record
are process-wide."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from typing import TYPE_CHECKING, Iterator

from .remote import remote_store
from .trust import make_private_dirs

if TYPE_CHECKING:
    from .store import EnvironmentCache

log = logging.getLogger("comfyui_accel")

ONE_SCOPE_AT_A_TIME = threading.RLock()  # also what `cache clear` takes (store.clear_disk_cache)


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


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

    with endpoint.serving(env_id), scoped_env("TORCHINDUCTOR_REDIS_URL", endpoint.url), \
            inductor_config.patch(fx_graph_remote_cache=True), \
            functorch_config.patch(enable_remote_autograd_cache=True):
        yield


@contextlib.contextmanager
def own_artifact_record() -> Iterator[object | None]:
    """torch's Mega-Cache record, fresh for this block: what it compiles or hits is recorded apart from the rest
    of the process (whose own save_cache_artifacts() is left as it was). None where torch has no Mega-Cache."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError:
        yield None
        return
    with CacheArtifactManager.with_fresh_cache():
        yield CacheArtifactManager


class TorchScope:
    """The scopes in which torch reads and writes one environment's `inductor/`, and setting that folder aside
    when torch's files there turn out damaged."""

    def __init__(self, env: EnvironmentCache):
        self.env = env

    @contextlib.contextmanager
    def compiling(self, ident: str, label: str) -> Iterator[None]:
        """Wrap one of the pack's compiled calls: torch's caches read and write this environment's directory and
        whatever the call compiles is saved as the artifacts of compile key `ident` (see store.key_id). One such
        call at a time in the process: the scope sets a process-wide variable and torch's process-wide artifact
        record (and `loading` the same variable)."""
        env = self.env
        if not env.check_usable():
            yield
            return
        with ONE_SCOPE_AT_A_TIME:
            env.artifacts.load(ident)
            with scoped_env("TORCHINDUCTOR_CACHE_DIR", str(env.inductor_dir)), \
                    torch_caches_on_the_store(env.env_id), own_artifact_record() as record:
                from torch._dynamo.utils import counters

                frames = counters["frames"]["ok"]
                yield
                if record is not None and counters["frames"]["ok"] != frames:
                    env.artifacts.save(ident, label, record)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Loading precompiled functions: torch's caches in this environment's directory, where the child left the
        compiled kernels (elsewhere torch would build them again: seconds)."""
        if not self.env.check_usable():
            yield
            return
        with ONE_SCOPE_AT_A_TIME, scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.env.inductor_dir)):
            yield

    def set_aside_torch_files(self, label: str, why: str) -> None:
        """A compile inside this cache failed where the same compile outside it worked: torch's own files here are
        damaged (torch checks none of its generated code and kernels). `inductor/` is moved aside and deleted; the
        pack's artifacts, which carry checksums, rebuild it at each compile key's next use in a process, and new
        compiles write there again. Another process writing into the old folder meanwhile loses that write and
        compiles again, as this one did."""
        env = self.env
        with ONE_SCOPE_AT_A_TIME, env.lock:  # no compile of this process writes there meanwhile
            aside = env.dir / f".inductor-damaged-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.rename(env.inductor_dir, aside)
                make_private_dirs(env.inductor_dir)
            except OSError as err:
                env.stop_persisting(f"{type(err).__name__}: {err}")
                return
            shutil.rmtree(aside, ignore_errors=True)
            env.artifacts.forget_loaded()  # each key's artifacts are handed to torch again at its next compile
            env.stats["torch_files_set_aside"] += 1
        log.warning("[Accel] compile cache: torch's files in %s failed to load for %s (%s), and the same compile "
                    "outside the cache worked: they were damaged, and are rebuilt from the pack's artifacts and new "
                    "compiles. `python -m accel cache clear` starts the cache afresh.", env.inductor_dir, label, why)
