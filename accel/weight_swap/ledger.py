"""The per-model record that makes a weight swap one in-place copy that ComfyUI itself can undo.

A ComfyUI model (BaseModel) is shared by all its ModelPatcher clones. Each clone means "the base weights plus my
patches"; ComfyUI keeps the base in the parameters and, before loading a clone with other patches, restores it
from the clones' shared `backup` dict. A swapped clone changes the *base*:

- When it loads (ComfyUI's ON_LOAD callback, after ComfyUI applied its LoRA and other weight patches), every weight
  that does not hold the new base yet is overwritten in place with the tensor streamed from the source. `copy_`
  keeps the parameter object and its storage, so compiled graphs (weights are graph inputs) and CUDA graphs
  (static addresses) stay valid. Its patches are then re-applied on the new base by ComfyUI's own
  `patch_weight_to_device`, so LoRA equals LoRA on a freshly loaded model of the new weights.
- Before a weight is overwritten, an entry restoring the original goes into ComfyUI's backup dict (origin.py: a
  map of a file holding the original, no memory). That entry is the journal: if the swap fails half-way, ComfyUI's
  unpatch puts back exactly the weights already overwritten; and a clone without the swap (the input model) gets
  the original weights back through ComfyUI's ordinary unpatch, with no hook of ours in its path. The same holds
  when ComfyUI unloads or partially unloads the model: the next load of the swapped clone swaps again.
- Between loads of swapped clones (a LoRA strength change, another file), `park` keeps the swapped base in the
  parameters across ComfyUI's unpatch instead of restoring the original first and streaming the swap again.

Entries are recognised by their tensor (held weakly): once ComfyUI consumed and dropped one, its file map is
released. Everything here runs under the process-wide swap lock (patcher.py).
"""
from __future__ import annotations

import collections
import time
import weakref

from .origin import resolve_origin

ORIGIN = ("origin",)
# The shape of ComfyUI's own backup entries: ComfyUI reads `.weight` and `.inplace_update` and, for an in-place
# entry, copies `.weight` into the existing parameter.
Entry = collections.namedtuple("Dimension", ["weight", "inplace_update"])

_ledgers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ledger_for(patcher) -> "Ledger":
    ledger = _ledgers.get(patcher.model)
    if ledger is None:
        ledger = _ledgers[patcher.model] = Ledger(patcher.backup)
    elif ledger.backup is not patcher.backup:
        raise RuntimeError("Swap Weights: this model has patchers that do not share ComfyUI's weight backup "
                           "(it was wrapped in a second ModelPatcher); swap the weights of the loader's output.")
    return ledger


def base_value(patcher, key: str):
    """The weight `key` of an unswapped patcher's base (its loader's weights, without its patches)."""
    import comfy.utils

    ledger = _ledgers.get(patcher.model)
    if ledger is not None and ledger.base_of(key) != ORIGIN:
        return ledger.origin.entry_tensor(key)  # the parameters hold another swap's weights right now
    entry = patcher.backup.get(key)
    return entry.weight if entry is not None else comfy.utils.get_attr(patcher.model, key)


class Ledger:
    def __init__(self, backup: dict):
        self.backup = backup  # ComfyUI's backup dict, shared by every clone of the model
        self.origin = None  # where the original weights come back from (origin.py)
        self.markers: dict[str, weakref.ref] = {}  # key -> our restore-the-original entry's tensor
        self.base: dict[str, tuple] = {}  # key -> id of the source its parameter holds, while an entry is in place
        self.parked: dict[str, tuple] = {}  # keys held in place across ComfyUI's unpatch, by `park`
        self.sources: dict[tuple, object] = {}
        self.applied_uuid = None  # the swapped clone loaded last, and which of the swapped keys it patched
        self.applied_keys: frozenset[str] = frozenset()
        self.last: dict = {}  # the latest swap's numbers (tensors written so far, when it failed)

    # -- what the parameters hold -----------------------------------------------------------------
    def present(self, key: str) -> bool:
        marker, entry = self.markers.get(key), self.backup.get(key)
        return marker is not None and entry is not None and marker() is entry.weight

    def base_of(self, key: str) -> tuple:
        """Id of the source whose value is the base in this key's parameter: ORIGIN unless our entry is still in
        ComfyUI's backup (no unpatch since the swap) or the key is parked."""
        if key in self.parked:
            return self.parked[key]
        return self.base.get(key, ORIGIN) if self.present(key) else ORIGIN

    def _prune(self) -> None:
        for key in [k for k in self.markers if k not in self.parked and not self.present(k)]:
            del self.markers[key]  # ComfyUI restored the original from it
            self.base.pop(key, None)

    def _entry(self, key: str) -> Entry:
        entry = Entry(self.origin.entry_tensor(key), True)
        self.markers[key] = weakref.ref(entry.weight)
        return entry

    def _original_value(self, patcher, key: str):
        """The original weight while the base is still the original: ComfyUI's backup of it if ComfyUI patched it
        at this load, else the parameter."""
        import comfy.utils

        entry = None if self.present(key) else self.backup.get(key)
        return entry.weight if entry is not None else comfy.utils.get_attr(patcher.model, key)

    # -- the swap ---------------------------------------------------------------------------------
    def sync(self, patcher, target, hints: list[str], force_patch_weights: bool) -> dict:
        """Make the parameters hold `target` as their base, under the patcher's patches. Called by ON_LOAD."""
        import comfy.model_management
        import comfy.utils

        start = time.perf_counter()
        self._prune()
        if self.origin is None:
            self.origin = resolve_origin(patcher, hints, lambda k: self._original_value(patcher, k), patcher.model)
        to_origin = target.id == self.origin.id  # swapping back to the file the model was loaded from
        want = ORIGIN if to_origin else target.id
        self.sources[target.id] = target
        keys = target.keys()
        stale = {k for k in keys if self.base_of(k) != want}
        stats = self.last = {"source": target.label, "tensors": 0, "bytes": 0, "spilled": 0, "origin": self.origin.kind}
        progress = comfy.utils.ProgressBar(len(stale)) if stale else None
        try:
            if stale:
                with target.open() as reader:
                    for key in keys:
                        if key not in stale:
                            self._settle(key, to_origin)
                            continue
                        # ComfyUI's interrupt (the queue's cancel button, POST /interrupt) stops a swap half-way
                        comfy.model_management.throw_exception_if_processing_interrupted()
                        value = reader.read(key)
                        stats["spilled"] += self._rewrite(patcher, key, value, target, to_origin, force_patch_weights)
                        stats["tensors"] += 1
                        stats["bytes"] += value.numel() * value.element_size()
                        progress.update(1)
            else:
                for key in keys:
                    self._settle(key, to_origin)
        except BaseException:
            self._rollback(patcher)
            raise
        self.parked.clear()
        # keep only the sources still in the parameters: a MODEL source keeps another model alive
        self.sources = {sid: src for sid, src in self.sources.items() if sid in set(self.base.values())}
        self.applied_uuid = patcher.patches_uuid
        self.applied_keys = frozenset(patcher.patches) & frozenset(keys)
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _settle(self, key: str, to_origin: bool) -> None:
        """The parameter already holds the wanted base: make sure its restore entry is ComfyUI's backup (it may hold
        ComfyUI's own entry made when it patched the key at this load, or be parked)."""
        self.parked.pop(key, None)
        if not to_origin and not self.present(key):
            self.backup[key] = self._entry(key)

    def _rewrite(self, patcher, key: str, value, target, to_origin: bool, force_patch_weights: bool) -> int:
        """Overwrite one weight's base in place and re-apply the patcher's patches on it. Returns 1 if the original
        had to be spilled first."""
        import comfy.utils

        spilled = 0
        comfy_entry = None if self.present(key) else self.backup.get(key)
        owner = comfy.utils.get_attr(patcher.model, key.rsplit(".", 1)[0])
        patched = key in patcher.patches and (comfy_entry is not None or force_patch_weights
                                              or getattr(owner, "comfy_patched_weights", False))
        if to_origin:
            comfy.utils.copy_to_param(patcher.model, key, value)
            self.backup.pop(key, None)  # the parameter holds the original base now
            self.parked.pop(key, None)
            self.base.pop(key, None)
            self.markers.pop(key, None)
        else:
            if not self.present(key):
                if self.origin.needs_write(key):  # journal first: the original is safe before it is overwritten
                    assert self.base_of(key) == ORIGIN, key
                    self.origin.write(key, self._original_value(patcher, key))
                    spilled = 1
                self.backup[key] = self._entry(key)
            comfy.utils.copy_to_param(patcher.model, key, value)
            self.base[key] = target.id
            self.parked.pop(key, None)
        if patched:
            # ComfyUI's own patching, on the new base: with our entry in the backup it backs nothing up and
            # computes from the parameter (for a return to the original it backs up the original, as usual).
            patcher.patch_weight_to_device(key, device_to=comfy.utils.get_attr(patcher.model, key).device)
        return spilled

    def _rollback(self, patcher) -> None:
        """After a failure half-way: ComfyUI's unpatch restores every original weight (our entries cover each one
        the swap overwrote or parked) and leaves the model unloaded, as after any failed load."""
        for key in list(self.parked):
            self.backup[key] = self._entry(key)
        self.parked.clear()
        patcher.unpatch_model(patcher.offload_device)
        self._prune()

    # -- between two swapped clones ---------------------------------------------------------------
    def park(self, patcher) -> None:
        """Before a swapped clone loads over another swapped clone: keep the swapped base in the parameters across
        ComfyUI's unpatch. Keys the loaded clone patched get an entry restoring the swapped base (not the original);
        the others leave the backup, so ComfyUI does not touch them. `unpark` (or the swap) puts our entries back."""
        current = getattr(patcher.model, "current_weight_patches_uuid", None)
        if current is None or current == patcher.patches_uuid:
            return  # ComfyUI will not unpatch
        maybe_patched = self.applied_keys if current == self.applied_uuid else None
        for key in list(self.markers):
            source = self.sources.get(self.base.get(key))
            if not self.present(key) or source is None:
                continue
            self.parked[key] = source.id
            if maybe_patched is None or key in maybe_patched:
                self.backup[key] = Entry(source.mapped(key), True)
            else:
                del self.backup[key]

    def unpark(self) -> None:
        for key in list(self.parked):
            self.backup[key] = self._entry(key)
        self.parked.clear()
