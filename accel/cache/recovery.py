"""A compile inside the persistent cache's scope, and what a failure there costs: the persistence at most, never
the compiled path. The call compiles again outside the cache (torch's temporary cache directory):
- a disk that fills up: the cache stops being used by this process (one warning);
- any other failure: if the compile works outside, torch's files in the cache were damaged and are set aside
  (store.py); if it fails there too, the error is the compile's own and propagates."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

from .store import EnvironmentCache, out_of_room

T = TypeVar("T")


def innermost(err: BaseException) -> BaseException:
    """The exception `err` wraps, innermost: Dynamo wraps backend errors in BackendCompilerFailed."""
    while (inner := getattr(err, "inner_exception", None) or err.__cause__) is not None:
        err = inner
    return err


def root_cause(err: BaseException) -> str:
    """The innermost exception's type and first line."""
    err = innermost(err)
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def must_propagate(err: BaseException) -> bool:
    """Errors that are not the compile's: out of memory, and ComfyUI's interrupt (raised from a progress hook)."""
    return isinstance(err, torch.OutOfMemoryError) or type(err).__name__ == "InterruptProcessingException"


def compile_in_cache(cache: EnvironmentCache, ident: str, name: str, label: str, call: Callable[[], T],
                     call_again: Callable[[], T]) -> T:
    """`call()` inside the cache's scope for the kind `ident` (entry `name`, `label` in messages); should the cache
    fail it, `call_again()` outside it (fresh inputs: the first call may have changed its own in place)."""
    try:
        with cache.compiling(ident, name):
            return call()
    except Exception as err:
        if not cache.usable or must_propagate(err):
            raise
        full, why = out_of_room(err), root_cause(err)
        if full:
            cache.stop_persisting(why)
    out = call_again()  # outside the scope: torch's own cache directory
    if not full:
        cache.set_aside_torch_files(label, why)
    return out
