"""The saving half of precompiled graphs, run only in a process of its own: the background child (compile_kind.py)
and `python -m accel precompile` (accel/precompile.py, through compile_kind.compile_item). A kind's graph for one
input layout made with torch's AOT precompile (`torch.compile(entry, fullgraph=True).aot_compile(...)`), guards and
Dynamo's output included, packed with the C++ kernel libraries it loads, under a file name of its context and
inputs. ComfyUI's process only loads them: compile/precompiled.py (the context a file is valid in, its format, and
the loading half) says what a file holds and when one is loaded.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
from typing import Callable

import torch


def _guard_filter(entries) -> list[bool]:
    """Which of Dynamo's guards the saved function keeps: what torch can save, minus the type checks on the block's
    submodules (ComfyUI's operation classes are nested, which torch refuses to save); the file's context
    (precompiled.context_of) stands for them."""
    from torch._dynamo.guards import CheckFunctionManager

    keep = []
    for guard in entries:
        unsaveable = guard.is_global or guard.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        on_a_type = "type(" in guard.name or "__mro__" in guard.name or (
            guard.guard_type == "TYPE_MATCH" and guard.has_value
            and type(guard.value).__qualname__ != type(guard.value).__name__)
        keep.append(not (unsaveable or on_a_type))
    return keep


def precompile(entry_point: Callable, compile_kwargs: dict, block, args: tuple, kwargs: dict,
               dynamic_dims: set) -> bytes:
    """One graph of a kind for these inputs (`dynamic_dims` (tensor index, dim) marked as maybe-dynamic, as the
    kind marks them in a compiled call), saved: the bytes of a precompiled function. Raises what torch raises
    (a graph break: fullgraph)."""
    kwargs_for_compile = dict(compile_kwargs)
    options = dict(kwargs_for_compile.pop("options", None) or {})
    mode = kwargs_for_compile.pop("mode", None)
    if mode:  # torch.compile takes a mode or options: the mode becomes its options
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, kwargs_for_compile.get("dynamic")), **options}
    options["guard_filter_fn"] = _guard_filter
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    for index, dim in dynamic_dims:
        if index < len(tensors) and dim < tensors[index].dim():
            torch._dynamo.maybe_mark_dynamic(tensors[index], dim)
    with torch._dynamo.config.patch(enable_aot_compile=True):  # scoped: read when the wrapper is made
        compiled = torch.compile(entry_point, fullgraph=True, options=options, **kwargs_for_compile)
    with _without_load_records(block):
        function = compiled.aot_compile(((block, *args), kwargs))
    return type(function).serialize(function).serialized_data


# ComfyUI 0.33 records each weight's dtype on its module when it loads a model (`<name>_comfy_model_dtype`,
# model_management.archive_model_dtypes and comfy.ops), for its own loading and casting; no block's forward reads
# them. torch 2.11 saves a module's attributes that no guard reads as "missing" by the object's identity, and a
# dtype is one object process-wide: every float32 tensor in the saved guards then loaded with no dtype
# (TypeError: empty_strided() ... not _Missing), so no block of any family could be precompiled on 0.33 and every
# kind loaded through Dynamo in ComfyUI's process. They are set aside while a graph is made and saved.
LOAD_RECORD_SUFFIX = "_comfy_model_dtype"


@contextlib.contextmanager
def _without_load_records(block: torch.nn.Module):
    """`block`'s modules without ComfyUI's load-time dtype records inside the `with`; put back after, also when
    it raises."""
    kept = [(module, name, module.__dict__.pop(name)) for module in block.modules()
            for name in [n for n in module.__dict__ if n.endswith(LOAD_RECORD_SUFFIX)]]
    try:
        yield
    finally:
        for module, name, value in kept:
            module.__dict__[name] = value


def kernels_of(payload: bytes, kernel_dir) -> dict[str, bytes]:
    """The compiled C++ kernel libraries a saved function loads, by path under torch's cache directory `kernel_dir`
    (the scope's TORCHINDUCTOR_CACHE_DIR): found by loading it once with inductor's per-process library caches
    emptied (this is the child's own process), so exactly its kernels register. Saved with the function, a new
    fleet worker loads them instead of building each one again with the C++ compiler (seconds a kernel on the
    CPU). GPU kernels travel inside the function already."""
    from torch._inductor.codecache import CppCodeCache, CppPythonBindingsCodeCache

    caches = (CppPythonBindingsCodeCache, CppCodeCache)
    kept = [dict(cache.cache) for cache in caches]
    try:
        for cache in caches:
            cache.cache.clear()
        torch.compiler.load_compiled_function(io.BytesIO(payload))
        keys = {key for cache in caches for key in cache.cache}
    finally:
        for cache, entries in zip(caches, kept):
            cache.cache.clear()
            cache.cache.update(entries)
    found = {}
    for key in sorted(keys):
        for path in sorted((kernel_dir / key[1:3]).glob(f"{key}*.so")):
            found[str(path.relative_to(kernel_dir))] = path.read_bytes()
    return found


def pack(function: bytes, kernels: dict[str, bytes]) -> tuple[bytes, dict]:
    """One file's payload (the function, then each kernel library) and the header entries that split it."""
    return function + b"".join(kernels.values()), {
        "function_size": len(function), "kernels": [[name, len(data)] for name, data in kernels.items()]}


def file_name(context: str, graph_key: tuple) -> str:
    """A graph's file name, from its context and its inputs' signature and marks: the same graph saved again
    (another child, another worker) keeps one file; inputs of one shape in another layout (Wan's transposed
    first input) are another graph."""
    return hashlib.sha256(repr((context, graph_key)).encode()).hexdigest()[:20]
