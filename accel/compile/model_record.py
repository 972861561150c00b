"""Per-model state of Compile Model: one record per diffusion model, scope, options and device, one lifetime.

A record holds what the APPLY_MODEL wrapper needs at every step and must not look up twice: the model's block
sites (module structure does not change), their registry entries, and auto mode's whole-call state. Records
hang off the diffusion model object (a weak key), so they live as long as the model; clones of a ModelPatcher
share the diffusion model and so share its records. One exception, kept from before this module: with
scope="whole model" the record's site holds the diffusion model itself, so that model's entry is never freed
(a known leak, one per model compiled whole).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch

from .. import comfy_names
from .auto_mode import AutoMode
from .blocks import BlockSite, find_repeated_blocks, whole_model_site
from .kinds import KindEntry
from .options import CompileOptions
from .registry import REGISTRY

log = logging.getLogger("comfyui_accel")
# comfy_names.NAMES: what ComfyUI's ModelPatcher records on the model when it (un)loads or patches it
LOAD_STATE = "BaseModel.current_weight_patches_uuid, model_loaded_weight_memory, lowvram_patch_counter"


@dataclass(eq=False)
class ModelRecord:
    label: str
    sites: list[BlockSite]
    entries: list[KindEntry]  # one per site (blocks of one kind share an entry)
    auto: AutoMode | None  # choose="auto" only
    options: CompileOptions  # the effective options it runs under
    last_call: dict = field(default_factory=dict)  # how its latest call's blocks ran (compiled, eager and why)
    # The shapes of the model call's tensor inputs (auto_mode.inputs_key) of calls in which every kind was
    # settled: a repeat of those needs no look for a new shape to send to the background compiler.
    inputs_seen: set = field(default_factory=set)


@dataclass
class _ModelState:
    sites: dict[bool, list[BlockSite]] = field(default_factory=dict)  # by whole_model
    records: dict[tuple, ModelRecord] = field(default_factory=dict)  # by (whole_model, options, device)
    settled: tuple | None = None  # the load state at which requires_grad was last settled


_states: "weakref.WeakKeyDictionary[torch.nn.Module, _ModelState]" = weakref.WeakKeyDictionary()


def model_record(base_model, options: CompileOptions, device: torch.device, whole_model: bool) -> ModelRecord:
    """The record of `base_model`'s diffusion model for these (effective) options on `device`."""
    diffusion_model = base_model.diffusion_model
    state = _states.get(diffusion_model)
    if state is None:
        state = _states[diffusion_model] = _ModelState()
    _settle_requires_grad(base_model, diffusion_model, state)
    key = (whole_model, options, str(device))
    record = state.records.get(key)
    if record is None:
        sites = _sites(diffusion_model, whole_model, state)
        label = f"{type(base_model).__name__}@{id(base_model):x}"
        entries = [REGISTRY.entry(site.kind, site.forward, options, device) for site in sites]
        auto = AutoMode(label) if options.choose == "auto" else None
        record = state.records[key] = ModelRecord(label, sites, entries, auto, options)
        REGISTRY.note_model(record)
    return record


def records_of(base_model) -> list[ModelRecord]:
    """Every record of `base_model`'s diffusion model (its options and devices so far)."""
    state = _states.get(base_model.diffusion_model)
    return list(state.records.values()) if state is not None else []


def _sites(diffusion_model: torch.nn.Module, whole_model: bool, state: _ModelState) -> list[BlockSite]:
    if whole_model not in state.sites:
        sites = [whole_model_site(diffusion_model)] if whole_model else find_repeated_blocks(diffusion_model)
        state.sites[whole_model] = sites
        if not sites:  # a family's blocks kept otherwise than in a ModuleList, or a renamed UNet block class
            log.warning("[Accel] Compile Model: found no repeated blocks in %s (ComfyUI %s): it runs eagerly "
                        "(docs/comfyui_compat.md).", type(diffusion_model).__name__, comfy_names.comfyui_version())
        log.info("[Accel] Compile Model: %d blocks of %d kinds in %s", len(sites), len({s.kind for s in sites}),
                 type(diffusion_model).__name__)
    return state.sites[whole_model]


def _settle_requires_grad(base_model, diffusion_model: torch.nn.Module, state: _ModelState) -> None:
    # ComfyUI 0.3.75 leaves requires_grad=True on the UNet's parameters while its weight patches (LoRA,
    # Swap Weights) create requires_grad=False ones; compiled graphs guard on that flag, so the first patch
    # would recompile every block. Inference never needs gradients; newer ComfyUI sets this itself.
    # Parameters change only when ComfyUI (un)patches or (re)loads weights, so the scan runs once per load state.
    load_state = tuple(comfy_names.attr(base_model, name, LOAD_STATE) for name in
                       ("current_weight_patches_uuid", "model_loaded_weight_memory", "lowvram_patch_counter"))
    if state.settled == load_state:
        return
    if any(p.requires_grad for p in diffusion_model.parameters()):
        diffusion_model.requires_grad_(False)
    state.settled = load_state
