"""Process-wide registry of compiled block kinds: one compiled entry point per kind, shared by every model.

The key is what determines the compiled code: the block's class and parameter signature, the device kind and
capability, torch's version and the compile options. ModelPatcher clones, re-executions of the node and a
second model of the same architecture therefore find the same entry and compile nothing new; the weights are
graph inputs, never baked in.

The registry also lists the models alive now (their records, model_record.py) for stats: a record goes with its
model, so nothing here grows with the models a process has seen.
"""
from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import replace
from typing import Any, Callable

import torch

from ..cache import COMPILE_CACHE
from .background import BACKGROUND
from .blocks import BlockKind
from .kinds import KindEntry, device_signature
from .options import CompileOptions


class GraphRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple, KindEntry] = {}
        self._labels: dict[str, str] = {}  # label -> the signature that has it, so two kinds never share one
        self._models: "weakref.WeakSet" = weakref.WeakSet()  # model_record.ModelRecord of live models
        # precompile only (record_compiled_calls): kind key -> background.Capture of its compiled calls' layouts;
        # read once per model call (dispatch.dispatcher_class), never per block call
        self.recorded: dict | None = None

    def entry(self, kind: BlockKind, forward: Callable, options: CompileOptions, device: torch.device) -> KindEntry:
        key = (kind.class_name, kind.signature, device_signature(device), torch.__version__,
               options.cache_key(device.type))
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                found = self._entries[key] = KindEntry(key, self._distinct(kind), forward, options, device.type)
            return found

    def _distinct(self, kind: BlockKind) -> BlockKind:
        """`kind` with a label no other kind of this process has: two kinds that look alike in a label (same
        class, channels and depth) get their signature's start appended, so stats and log tell them apart."""
        owner = self._labels.setdefault(kind.label, kind.signature)
        if owner == kind.signature:
            return kind
        return replace(kind, label=f"{kind.label}#{kind.signature[:6]}")

    def forget_shapes(self) -> None:
        """Back to "no shape seen yet" for every kind, as in a fresh process (used by precompile only)."""
        with self._lock:
            for entry in self._entries.values():
                entry.shapes.forget()

    def record_compiled_calls(self) -> dict:
        """From the next model call on, every kind's compiled calls are recorded (used by precompile only, in its own
        process; its blocks get dispatch.RecordingDispatcher): a dict, kind key -> background.Capture with the kind's
        first block and one call's input layouts per input signature, in call order, as a child's job holds them.
        Precompile then saves each kind whole from it."""
        self.recorded = {}
        return self.recorded

    def note_model(self, record) -> None:
        with self._lock:
            self._models.add(record)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._entries.values())
            records = list(self._models)
        kinds = [e.stats() for e in entries]
        models: dict[str, list[str]] = {}
        for record in records:
            models.setdefault(record.label, [])
            models[record.label] = sorted(set(models[record.label]) | {e.name for e in record.entries})
        return {
            "kinds": kinds,
            "models": models,
            "whole_call_checks": {r.label: r.auto.stats(r.entries) for r in records if r.auto is not None},
            "last_calls": {r.label: r.last_call for r in records if r.last_call},
            "totals": {
                "kinds": len(kinds),
                "compiles": sum(k["compiles"] for k in kinds),
                "recompiles": sum(k["recompiles"] for k in kinds),
                "cache_hits": sum(k["cache_hits"] for k in kinds),
                "compile_seconds": round(sum(k["compile_seconds"] for k in kinds), 3),
                "disk_cache": dict(sum((Counter(k["disk_cache"]) for k in kinds), Counter())),
            },
            "compile_cache": COMPILE_CACHE.stats(),
            "background": BACKGROUND.stats(),
        }


REGISTRY = GraphRegistry()
