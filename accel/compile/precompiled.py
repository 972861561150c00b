"""A kind's graphs saved whole by torch's AOT precompile, and loaded in another process without Dynamo tracing.

The child (compile/child/compile_kind.py, which saves through compile/child/saving.py; `python -m accel precompile`
runs the same code, accel/precompile.py) compiles each captured input layout of a kind with
`torch.compile(entry, fullgraph=True).aot_compile(...)` and saves the result, guards and Dynamo's output included, as
a precompiled function in the persistent cache (store.py: owner-only files with a checksum, signed in the remote
store). ComfyUI's process, a restarted one, or a new fleet worker loads them with
`torch.compiler.load_compiled_function`: milliseconds a kind where Dynamo tracing the block again took seconds. This
module is the loading half, and what both halves share: the files' FORMAT, the context a file is valid in
(`context_of`), and whether precompiling is available (`unavailable`).

A call is served by the first loaded function whose guards accept its inputs (a static graph for the first
shape, dynamic ones once a second shape was seen, as the child's marks made them); inputs no guard accepts get
no graph here (`NO_GRAPH`): the caller runs them eagerly and a child compiles them, or compiles them in-process
the old way.

Guards torch cannot save are dropped from the saved function (the default of `aot_compile`, plus type checks on
ComfyUI's operation classes, which are nested classes such as `disable_weight_init.Conv2d`). What they checked is
the pack's to check instead, before a function is loaded for a block: the `context` of the file names every class
in the block's module tree, ComfyUI's version and its compute flags and the attention function it picked, and the
attention override the pack passes to compiled blocks. A file of another context is not loaded.

Where torch lacks AOT precompile, a block cannot be captured whole, or `ACCEL_PRECOMPILED=0`, kinds load as before
(Dynamo traces them again and torch's on-disk caches give the compiled code), and the stats say why.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..env_settings import OFF_VALUES

log = logging.getLogger("comfyui_accel")

ENV = "ACCEL_PRECOMPILED"
NO_GRAPH = object()  # `PrecompiledGraphs.call`'s answer when no loaded function accepts the inputs
# Bump when what a file holds changes. Not for a change of what the context digests (NOT_COMPUTE_FLAGS below): the
# digests change with it anyway, so old files then serve no call and a child saves new ones off the prompt's path.
# A file of another FORMAT is not loaded, and its kind does not count as precompiled (`loadable`, which
# store.has_precompiled asks): a child makes files of this FORMAT off the prompt's path, as for a kind without any.
FORMAT = 3
# ComfyUI flags that change no compiled code: where it listens, logs and keeps files, how it reads and allocates
# memory for weights (fleet workers differ there, and `python -m accel precompile` has none of a server's)
NOT_COMPUTE_FLAGS = ("listen", "port", "tls", "cors", "dir", "directory", "path", "preview", "log", "verbose",
                     "launch", "upload", "front_end", "user", "database", "multi_user", "quick_test", "metadata",
                     "manager", "windows", "whitelist", "api", "comfy_api", "temp", "input", "output", "cache_",
                     "enable_compress", "disable_all_custom_nodes", "hash", "print_server", "mmap",
                     "pinned_memory", "cuda_malloc", "reserve_vram", "smart_memory")


def loadable(header: dict) -> bool:
    """Whether this pack loads a precompiled function file with this header (its format is this pack's)."""
    return header.get("format") == FORMAT


def unavailable() -> str:
    """Why kinds cannot be precompiled here ("" when they can)."""
    raw = os.environ.get(ENV, "").strip()  # on unless set to an off value (empty: unset)
    if raw and raw.lower() in OFF_VALUES:
        return f"off ({ENV}={raw})"
    if not hasattr(torch.compiler, "load_compiled_function") or not hasattr(torch._dynamo.config,
                                                                             "enable_aot_compile"):
        return f"torch {torch.__version__} has no AOT precompile (torch.compiler.load_compiled_function)"
    return ""


# -- the context a saved function is valid in ---------------------------------------------------------
_comfy_identity: str | None = None
_block_contexts: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_contexts_lock = threading.Lock()
_with_passed: dict[tuple, str] = {}  # (block context, functions passed in the call's dicts) -> context


def comfyui_identity() -> str:
    """ComfyUI's version, its compute flags and the attention functions it picked at import."""
    global _comfy_identity
    if _comfy_identity is None:
        from comfy.cli_args import args
        import comfy.ldm.modules.attention as attention

        try:
            import comfyui_version

            version = comfyui_version.__version__
        except ImportError:
            version = "unknown"
        flags = {}
        for name, value in sorted(vars(args).items()):
            if any(part in name for part in NOT_COMPUTE_FLAGS):
                continue
            try:
                flags[name] = json.loads(json.dumps(value))
            except (TypeError, ValueError):
                continue
        picked = [_name_of(getattr(attention, name, None)) for name in
                  ("optimized_attention", "optimized_attention_masked")]
        _comfy_identity = json.dumps([version, flags, picked], sort_keys=True, default=str)
    return _comfy_identity


def _name_of(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def context_of(block: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict) -> str:
    """The context of this compiled call of `block` (module docstring): a digest of the block's classes (cached per
    block object), ComfyUI's identity, the forward compiled, and the functions passed in the call's dicts (the
    attention override of compiled blocks)."""
    with _contexts_lock:
        found = _block_contexts.get(block)
    if found is None:
        classes = sorted({_name_of(t) for m in block.modules() for t in type(m).__mro__})
        text = json.dumps([FORMAT, comfyui_identity(), classes, _name_of(forward)])
        found = hashlib.sha256(text.encode()).hexdigest()[:16]
        with _contexts_lock:
            _block_contexts[block] = found
    # by qualified name only: the pack's own functions live in a module named after its folder inside ComfyUI
    passed = tuple(tuple(sorted((key, getattr(v, "__qualname__", type(v).__name__)) for key, v in value.items()))
                   for value in (*args, *kwargs.values()) if isinstance(value, dict))
    if not passed:
        return found
    digest = _with_passed.get((found, passed))  # every block call asks: hashed once per combination
    if digest is None:
        digest = _with_passed[(found, passed)] = hashlib.sha256(f"{found}:{passed}".encode()).hexdigest()[:16]
    return digest


def warm_loader() -> None:
    """Import what loading a precompiled function imports the first time in a process (inductor's code generation
    modules, which its saved wrapper code names: about 1.2 s on the 2-core test CPU), so the first kind loaded
    in a prompt pays only its own ~30 ms. Run off the prompt's path (the CPU checks' thread)."""
    if unavailable():
        return
    import torch._inductor.async_compile  # noqa: F401
    import torch._inductor.codegen.memory_planning  # noqa: F401
    import torch._inductor.select_algorithm  # noqa: F401


# -- a saved file's kernel libraries, unpacked (packed by compile/child/saving.py) ---------------------
KERNEL_PATH = re.compile(r"[a-z0-9]{2}/[a-z0-9]+(\.[a-z]+)*\.so")  # torch's <key[1:3]>/<key>.main.so, nothing else


def unpack(header: dict, payload: bytes, kernel_dir) -> bytes:
    """The function's bytes; its kernel libraries written under `kernel_dir` where they are missing (owner-only,
    atomically: store.write_atomic). A name that is not a kernel's path raises ValueError (the file was checked,
    but never a path out of torch's directory)."""
    from ..cache.store import write_atomic

    size = header.get("function_size", len(payload))
    offset = size
    for name, length in header.get("kernels", ()):
        if not KERNEL_PATH.fullmatch(name):
            raise ValueError(f"not a kernel library's path: {name!r}")
        path = kernel_dir / name
        if not path.exists():
            write_atomic(path, payload[offset:offset + length])
        offset += length
    return payload[:size]


# -- this process's side ----------------------------------------------------------------------------------
class PrecompiledGraphs:
    """The precompiled functions of one kind loaded in this process, per context (usually one)."""

    def __init__(self):
        self.functions: dict[str, list] = {}  # context -> loaded functions, in the order they were made
        self.loaded_names: set[str] = set()
        self.due = False  # the cache may hold functions not loaded yet (a child saved some, or found at start)
        self.looked_up = False  # the cache was asked for them before a first compile here (precompiled_runner.py)
        self.load_seconds = 0.0
        self.calls = 0
        self.refusals: list[str] = []  # files not loaded, and why
        self._other_contexts: set[str] = set()  # contexts met with no function of theirs (logged once each)

    @property
    def expected(self) -> bool:
        """Functions are loaded, or due to be."""
        return self.due or bool(self.functions)

    def load_due(self, read_files: Callable[[], list], kernel_dir=None) -> None:
        """If functions are due, read the kind's files (`read_files()`) and load those not loaded yet. They stay due
        until loaded: meanwhile the kind's calls run eagerly as before (KindEntry.loads_between_prompts), rather than
        find neither a due load nor a function."""
        if self.due:
            try:
                self.load(read_files(), kernel_dir)
            finally:
                self.due = False

    def load(self, files: list[tuple[dict, bytes]], kernel_dir=None) -> int:
        """Load the functions of `files` not loaded yet (their kernel libraries put under `kernel_dir` first);
        how many. A file torch cannot load is left, with a log line (that kind's calls go the old way)."""
        start, made = time.perf_counter(), 0
        for header, payload in files:
            name = header.get("name", "")
            if name in self.loaded_names or not loadable(header):
                continue
            self.loaded_names.add(name)
            try:
                if kernel_dir is not None:
                    payload = unpack(header, payload, kernel_dir)
                # Its guards are rebuilt here, and a tensor's dispatch keys are read against the thread's modes:
                # rebuilt outside inference mode, they refused the inference tensors of ComfyUI's sampling.
                with torch.inference_mode(header.get("inference", False)), \
                        torch.set_grad_enabled(header.get("grad", False)):
                    function = torch.compiler.load_compiled_function(io.BytesIO(payload))
            except Exception as err:  # noqa: BLE001  (another torch build, a damaged file: the old path)
                why = f"{type(err).__name__}: {str(err)[:200]}"
                self.refusals.append(why)
                log.info("[Accel] Compile Model: a precompiled function of %s did not load (%s); that graph loads "
                         "through Dynamo instead", header.get("label"), why)
                continue
            self.functions.setdefault(header["context"], []).append(function)
            made += 1
        self.load_seconds += time.perf_counter() - start
        return made

    def serve(self, block, forward: Callable, args: tuple, kwargs: dict, label: str = ""):
        """`call` in this compiled call's context (`context_of`): the one entry a warm precompiled call makes here."""
        return self.call(context_of(block, forward, args, kwargs), block, args, kwargs, label)

    def call(self, context: str, block, args: tuple, kwargs: dict, label: str = ""):
        """The block's output from the first function of `context` whose guards accept these inputs, else
        NO_GRAPH (nothing ran)."""
        if context not in self.functions and context not in self._other_contexts:
            self._other_contexts.add(context)
            log.info("[Accel] Compile Model: the precompiled graphs of %s were made for other blocks or settings "
                     "(their classes, ComfyUI's flags or attention); these calls get graphs of their own", label)
        for function in self.functions.get(context, ()):
            if function.guard_check(block, *args, **kwargs):
                self.calls += 1
                return function.fn(block, *args, **kwargs)  # guards just checked: their compiled code
        return NO_GRAPH

    def stats(self) -> dict:
        return {"functions": sum(len(f) for f in self.functions.values()), "calls": self.calls,
                "load_seconds": round(self.load_seconds, 3), "refused": list(self.refusals[-5:])}
