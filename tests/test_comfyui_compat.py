"""The ComfyUI names the pack uses beyond ComfyUI's public mechanisms (accel/comfy_names.NAMES, listed in
docs/comfyui_compat.md): each exists with the shape the pack expects on the running ComfyUI (CI runs 0.3.75 and
0.33.0), the list, the doc and the source agree, a missing name gives its warning and a pass-through, and the
changes of ComfyUI after 0.33 that touch the pack (a "config" patch, a clone keeping a new flag, a context manager
around inner_sample) are handled.

The source scan finds what the pack reaches in ComfyUI: what it imports from ComfyUI's modules (through any alias),
the attributes it reads from the objects ComfyUI hands it (patchers, models, guiders, VAEs: by the variable names
the pack gives them) and the attributes it asks for by string (getattr/hasattr). Each must be a public mechanism,
torch's own, or spelled by an entry of NAMES.
"""
from __future__ import annotations

import ast
import contextlib
import importlib.util
import copy
import inspect
import logging
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "comfyui_compat.md"
SD15 = "accel-sd15-small.safetensors"

# -- the scan -----------------------------------------------------------------------------------------------
COMFY_MODULES = ("comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "comfyui_version",
                 "latent_preview", "node_helpers")
# ComfyUI's public mechanisms (the pack's rules): wrappers and callbacks, PromptServer.
PUBLIC_DOTTED = ("comfy.patcher_extension.WrappersMP", "comfy.patcher_extension.CallbacksMP", "server.PromptServer")
# The variable names the pack gives to what ComfyUI hands it (a patcher, its model, a guider, a VAE, ...).
RECEIVERS = {"patcher", "model_patcher", "base_model", "diffusion_model", "unet", "guider", "vae", "clone", "model",
             "out", "compiled", "weights_model", "other", "class_obj", "model_sampling", "oam", "attention", "mm"}
# ModelPatcher's public API (clones, wrappers, callbacks, attachments, object patches, model_options), torch's own.
PUBLIC_ATTRS = {
    "clone", "model", "model_options", "get_model_object", "add_object_patch", "add_wrapper_with_key",
    "remove_wrappers_with_key", "add_callback_with_key", "remove_callbacks_with_key", "set_attachments",
    "get_attachment", "remove_attachments", "set_model_patch_replace", "class_obj", "load_device",
} | set(dir(torch.nn.Module)) | set(dir(torch.Tensor)) | set(dir(dict)) | {"name", "aot_compile"}
# The pack's own attributes on objects it names like ComfyUI's (its records, plans and options).
PACK_ATTRS = {"patcher", "module", "kind", "path", "attribute", "options", "label", "sites", "entries", "auto",
              "choose", "whole_model", "method", "entry", "h", "config", "interval", "depth", "plan"}


def _pack_files():
    return sorted([*ROOT.glob("accel/**/*.py"), *ROOT.glob("nodes/*.py")])


def _imported(tree) -> dict[str, str]:
    """Local name -> the ComfyUI dotted name it stands for (import comfy.x as y, from comfy.x import z)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in COMFY_MODULES:
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                        alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in COMFY_MODULES:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def comfy_uses(path: Path) -> set[tuple[str, str]]:
    """(what, where) for each ComfyUI name the file reaches: dotted module names, and attributes of ComfyUI objects
    (by the RECEIVERS' names) read or asked for by string."""
    tree = ast.parse(path.read_text())
    imported = _imported(tree)
    found = set()
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}  # a chain's own parts
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in COMFY_MODULES:
            found |= {(f"{node.module}.{a.name}", "import") for a in node.names}
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _dotted(node)
            if chain and chain[0] in imported:
                found.add((".".join([imported[chain[0]], *chain[1:]]), "module"))
            elif chain and len(chain) >= 2 and chain[-2] in RECEIVERS and chain[0] not in ("self", "cls"):
                found.add((chain[-1], "attribute"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            receiver = _dotted(node.args[0])
            if receiver and receiver[-1] in RECEIVERS:
                found.add((node.args[1].value, "attribute"))
    return found


def _covered(what: str, kind: str, tokens: set[str]) -> bool:
    """Whether a use is public, the pack's own, or spelled by a NAMES entry (a module name: the name itself or the
    ComfyUI object it is read from, e.g. comfy.cli_args.args for args.cpu)."""
    if kind == "attribute":
        return what in PUBLIC_ATTRS or what in PACK_ATTRS or what in tokens
    if any(what == p or what.startswith(p + ".") for p in PUBLIC_DOTTED):
        return True
    if kind == "import" and _is_module(what):
        return True  # a module: what the pack takes from it is scanned where it is used
    parts = what.split(".")
    return what in tokens or any(parts[i - 1] in tokens or ".".join(parts[:i]) in tokens
                                 for i in range(2, len(parts) + 1))


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:  # a name inside a module, not a module
        return False


def _doc_names() -> list[str]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def test_names_the_doc_and_the_source_agree(accel_pack):
    names = accel_pack.accel.comfy_names.NAMES
    listed = _doc_names()
    assert len(listed) == len(set(listed)), "a name is listed twice in docs/comfyui_compat.md"
    assert set(listed) == set(names), (f"in the doc, not in accel/comfy_names.py: {sorted(set(listed) - set(names))}; "
                                       f"in accel/comfy_names.py, not in the doc: {sorted(set(names) - set(listed))}")
    for entry in names.values():  # a listed name the pack no longer uses where it says
        texts = {file: (ROOT / file).read_text() for file in entry.files}
        gone = [t for t in entry.tokens if not any(t in text for text in texts.values())]
        assert not gone, f"{entry.name}: no longer spelled in {entry.files}: {gone}; update NAMES and the doc"
        idle = [file for file, text in texts.items() if not any(t in text for t in entry.tokens)]
        assert not idle, f"{entry.name}: {idle} no longer use it; update NAMES and the doc"
    tokens = {t for entry in names.values() for t in entry.tokens}
    unlisted = sorted({(what, str(path.relative_to(ROOT))) for path in _pack_files()
                       for what, kind in comfy_uses(path) if not _covered(what, kind, tokens)})
    assert not unlisted, f"ComfyUI names used but not listed in accel/comfy_names.NAMES and the doc: {unlisted}"


def test_the_scan_finds_an_unlisted_name(comfy_dir, tmp_path):
    """The scan itself: a new private read (a patcher field, a ComfyUI function) is found, a public one is not."""
    source = tmp_path / "probe.py"
    source.write_text("import comfy.model_management as mm\nfrom comfy.sd import load_lora_for_models\n\n"
                      "def f(patcher, executor):\n    mm.soft_empty_cache()\n    patcher.hook_patches\n"
                      "    patcher.clone()\n    getattr(patcher, 'weight_wrapper_patches', None)\n")
    uses = comfy_uses(source)
    assert {("comfy.model_management.soft_empty_cache", "module"), ("comfy.sd.load_lora_for_models", "import"),
            ("hook_patches", "attribute"), ("weight_wrapper_patches", "attribute")} <= uses
    new = {("comfy.model_management.soft_empty_cache", "module"), ("comfy.sd.load_lora_for_models", "import"),
           ("hook_patches", "attribute"), ("weight_wrapper_patches", "attribute")}
    assert not [u for u in new if _covered(*u, tokens=set())]
    assert _covered("clone", "attribute", set()) and ("clone", "attribute") in uses
    assert _covered("comfy.model_management", "import", set())  # a module: its uses are scanned


# -- each name on the running ComfyUI -------------------------------------------------------------------------
class Context:
    """One real model of each kind the pack meets, and one real sampling run recorded through public wrappers."""

    def __init__(self, comfy_nodes):
        import comfy.patcher_extension as pe

        (self.patcher,) = comfy_nodes.UNETLoader().load_unet(SD15, "default")
        self.base = self.patcher.model
        self.unet = self.base.diffusion_model
        (self.vae,) = comfy_nodes.VAELoader().load_vae("taesd")
        self.calls = {}
        recorder = self.patcher.clone()
        for kind in (pe.WrappersMP.OUTER_SAMPLE, pe.WrappersMP.APPLY_MODEL, pe.WrappersMP.DIFFUSION_MODEL):
            recorder.add_wrapper_with_key(kind, "test_compat", self._recorder(kind))
        import deepcache_runs

        deepcache_runs.sample(recorder, steps=2)

    def _recorder(self, kind):
        def record(executor, *args, **kwargs):
            self.calls.setdefault(kind, (executor.class_obj, args, kwargs))
            return executor(*args, **kwargs)
        return record


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _source(obj) -> str:
    return inspect.getsource(obj)


def _has(obj, *names):
    gone = [n for n in names if not hasattr(obj, n)]
    assert not gone, f"{getattr(obj, '__name__', type(obj).__name__)} has no {', '.join(gone)}"


def _version() -> tuple[int, ...]:
    import comfyui_version

    return tuple(int(p) for p in comfyui_version.__version__.split(".")[:3])


def _check_optimized_attention(c):
    import comfy.ldm.modules.attention as a

    assert callable(a.optimized_attention) and callable(a.optimized_attention_masked)


def _check_attention_names(c):
    import comfy.ldm.modules.attention as a

    assert a.attention_sub_quad.__name__ == "attention_sub_quad" and a.attention_split.__name__ == "attention_split"


def _check_override(c):
    import comfy.ldm.modules.attention as a

    assert 'transformer_options["optimized_attention_override"]' in _source(a)


def _check_class_names(c):
    import comfy.ldm.modules.attention as a
    import comfy.ldm.modules.diffusionmodules.openaimodel as o

    _has(o, "ResBlock", "VideoResBlock")
    _has(a, "SpatialTransformer", "SpatialVideoTransformer")
    assert {type(m).__name__ for m in c.unet.modules()} >= {"ResBlock", "SpatialTransformer"}


def _check_sampler_keys(c):
    import comfy.samplers

    import comfy.patcher_extension as pe

    options = c.calls[pe.WrappersMP.DIFFUSION_MODEL][1][5]
    for key in ("cond_or_uncond", "sigmas", "sample_sigmas", "uuids", "wrappers"):
        assert key in options, key
    assert ("prefetch_dynamic_vbars" in options) == ("prefetch_dynamic_vbars" in _source(comfy.model_base))
    assert isinstance(comfy.samplers, object)


def _check_patch_names(c):
    import comfy.ldm.modules.attention as a

    source = _source(a)
    for name in ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch"):
        assert f'"{name}"' in source, name
    assert '"patches_replace"' in source


def _check_layouts(c):
    import comfy.patcher_extension as pe

    sigmas = c.calls[pe.WrappersMP.OUTER_SAMPLE][1][3]
    assert isinstance(sigmas, torch.Tensor) and sigmas.ndim == 1
    assert isinstance(c.calls[pe.WrappersMP.DIFFUSION_MODEL][1][5], dict)
    _, args, kwargs = c.calls[pe.WrappersMP.APPLY_MODEL]
    assert len(args) >= 6 and args[4] is None and isinstance(args[5], dict)  # control, transformer_options


def _check_forward_patches(c):
    import comfy.ldm.modules.diffusionmodules.openaimodel as o

    used = set(re.findall(r'"(\w+_patch(?:_after_skip)?)"', _source(o.UNetModel._forward)))
    shallow = {"emb_patch", "input_block_patch", "input_block_patch_after_skip", "output_block_patch"}
    deep = {"middle_block_after_patch"}  # after the middle block: the deep part a reused step skips
    assert used - deep == shallow, f"UNetModel._forward's patch points changed: {sorted(used)}"
    for key in ('"block"', '"transformer_index"', '"original_shape"'):
        assert key in _source(o.UNetModel._forward), key


def _check_dit_lists(c):
    from comfy.ldm.chroma import model as chroma
    from comfy.ldm.flux import model as flux
    from comfy.ldm.hunyuan_video import model as hunyuan
    from comfy.ldm.lightricks import model as ltxv
    from comfy.ldm.modules.diffusionmodules import mmdit
    from comfy.ldm.qwen_image import model as qwen
    from comfy.ldm.wan import model as wan

    for cls, lists in ((flux.Flux, ("double_blocks", "single_blocks")), (chroma.Chroma, ("double_blocks",
                                                                                        "single_blocks")),
                       (hunyuan.HunyuanVideo, ("double_blocks", "single_blocks")), (wan.WanModel, ("blocks",)),
                       (qwen.QwenImageTransformer2DModel, ("transformer_blocks",)), (mmdit.MMDiT, ("joint_blocks",)),
                       (ltxv.LTXVModel, ("transformer_blocks",))):
        # built in __init__ or a helper of it (0.33's LTXVModel._init_transformer_blocks)
        built = "".join(_source(k) for k in cls.__mro__ if k.__module__.startswith("comfy."))
        for name in lists:
            assert re.search(rf"self\.{name}\s*=", built), f"{cls.__name__} builds no {name}"
        assert "original_block" in "".join(_source(k) for k in cls.__mro__ if k.__module__.startswith("comfy."))


def _check_double_block_patch(c):
    import comfy.model_patcher

    assert '"double_block"' in _source(comfy.model_patcher.ModelPatcher.set_model_double_block_patch)


def _check_context_window(c):
    import comfy.context_windows as cw

    assert "self.index_list" in _source(cw)


def _check_backup(c):
    import comfy.model_patcher

    assert isinstance(c.patcher.backup, dict)
    assert "'weight', 'inplace_update'" in _source(comfy.model_patcher.ModelPatcher.patch_weight_to_device)


def _check_patch_methods(c):
    assert _params(c.patcher.patch_weight_to_device)[:3] == ["key", "device_to", "inplace_update"]
    assert _params(c.patcher.unpatch_model)[:2] == ["device_to", "unpatch_weights"]
    assert isinstance(c.patcher.offload_device, torch.device)


def _check_patched_weights_flag(c):
    import comfy.model_patcher

    assert "comfy_patched_weights" in _source(comfy.model_patcher)


def _check_utils(c):
    import comfy.utils

    assert _params(comfy.utils.get_attr)[:2] == ["obj", "attr"]
    assert _params(comfy.utils.copy_to_param)[:3] == ["obj", "attr", "value"]


def _check_key_weight(c):
    from comfy.model_patcher import get_key_weight

    key = next(k for k in c.base.state_dict() if k.endswith(".weight"))
    weight, set_func, convert_func = get_key_weight(c.base, key)
    assert isinstance(weight, torch.Tensor)


def _check_prefix(c):
    from comfy.model_detection import unet_prefix_from_state_dict

    keys = dict.fromkeys(f"model.diffusion_model.{k}" for k in c.unet.state_dict())
    assert unet_prefix_from_state_dict(keys) == "model.diffusion_model."


def _check_model_type(c):
    assert hasattr(c.base.model_type, "name") and isinstance(c.base.model_config.sampling_settings, dict)
    assert _params(c.base.model_config.model_type)[:2] == ["state_dict", "prefix"]


def _check_cached_init(c):
    # 0.33's loaders record how to build the patcher again; 0.3.75's do not (the pack then spills the originals)
    init = getattr(c.patcher, "cached_patcher_init", None)
    if _version() >= (0, 33):
        assert init and isinstance(init[1][0], str) and Path(init[1][0]).name == SD15, init
    else:
        assert init is None


def _check_dynamic(c):
    if _version() >= (0, 33):
        assert c.patcher.is_dynamic() is False and "disable_dynamic" in _params(c.patcher.clone)
        import comfy.model_patcher

        assert callable(comfy.model_patcher.ModelPatcherDynamic.get_non_dynamic_delegate)
    else:
        assert not hasattr(c.patcher, "is_dynamic") and not hasattr(c.patcher, "get_non_dynamic_delegate")


def _check_current_patcher(c):
    import comfy.model_patcher

    assert "self.model.current_patcher" in _source(comfy.model_patcher.ModelPatcher)


def _check_folder_paths(c):
    import folder_paths

    assert Path(folder_paths.get_temp_directory()).is_absolute()
    assert SD15 in folder_paths.get_filename_list("diffusion_models")
    assert Path(folder_paths.get_full_path("diffusion_models", SD15)).is_file()


def _check_loader_inputs(c):
    import nodes

    assert "unet_name" in nodes.UNETLoader.INPUT_TYPES()["required"]
    assert "ckpt_name" in nodes.CheckpointLoaderSimple.INPUT_TYPES()["required"]


def _check_load_record(c):
    records = [n for m in c.unet.modules() for n in vars(m) if n.endswith("_comfy_model_dtype")]
    assert bool(records) == (_version() >= (0, 33)), records[:3]


def _check_weight_functions(c):
    import comfy.ops

    source = _source(comfy.ops)
    assert "s.weight_function" in source and "s.bias_function" in source


def _check_unet_layout(c):
    _has(c.unet, "input_blocks", "middle_block", "output_blocks", "time_embed", "num_classes", "model_channels",
         "out", "predict_codebook_ids", "default_num_video_frames")
    assert "self.label_emb" in _source(type(c.unet).__init__) and "self.id_predictor" in _source(type(c.unet).__init__)


def _check_unet_functions(c):
    import comfy.ldm.modules.diffusionmodules.openaimodel as o

    assert _params(o.forward_timestep_embed)[:6] == ["ts", "x", "emb", "context", "transformer_options", "output_shape"]
    assert _params(o.apply_control)[:3] == ["h", "control", "name"]
    assert _params(o.timestep_embedding)[:2] == ["timesteps", "dim"]


def _check_web(names):
    """The frontend ComfyUI serves (its pip package) spells each of these identifiers."""
    def check(c):
        import comfyui_frontend_package

        static = Path(comfyui_frontend_package.__file__).parent / "static"
        bundle = "".join(p.read_text(errors="ignore") for p in static.rglob("*.js"))
        gone = [n for n in names if n not in bundle]
        assert not gone, f"ComfyUI's frontend no longer has {gone}"
    return check


def _check_call(obj_of, *attributes):
    return lambda c: _has(obj_of(c), *attributes)


def _module(name):
    import importlib

    return lambda c: importlib.import_module(name)


CHECKS = {
    "comfy.ldm.modules.attention.optimized_attention": _check_optimized_attention,
    "comfy.ldm.modules.attention.optimized_attention_masked": _check_optimized_attention,
    "comfy.ldm.modules.attention.attention_pytorch":
        lambda c: _params(_module("comfy.ldm.modules.attention")(c).attention_pytorch)[:4] == ["q", "k", "v", "heads"]
        or pytest.fail("attention_pytorch takes other arguments"),
    "comfy.ldm.modules.attention.attention_sub_quad, attention_split (by __name__)": _check_attention_names,
    'transformer_options["optimized_attention_override"]': _check_override,
    "BaseModel.diffusion_model": lambda c: isinstance(c.base.diffusion_model, torch.nn.Module) or pytest.fail(),
    "BaseModel.model_lowvram": lambda c: isinstance(c.base.model_lowvram, bool) or pytest.fail(),
    "BaseModel.current_weight_patches_uuid, model_loaded_weight_memory, lowvram_patch_counter":
        _check_call(lambda c: c.base, "current_weight_patches_uuid", "model_loaded_weight_memory",
                    "lowvram_patch_counter"),
    "openaimodel.ResBlock, VideoResBlock; attention.SpatialTransformer, SpatialVideoTransformer (class names)":
        _check_class_names,
    "block forwards' transformer_options parameter":
        lambda c: "transformer_options" in _params(_module("comfy.ldm.modules.attention")(c).SpatialTransformer.forward)
        or pytest.fail(),
    "diffusion model's _forward (scope whole model)": _check_call(lambda c: type(c.unet), "_forward"),
    "cast modules' weight_function, bias_function (LoRA on a partial load)": _check_weight_functions,
    "<param>_comfy_model_dtype (0.33's load-time dtype records)": _check_load_record,
    "transformer_options keys the sampler sets": _check_sampler_keys,
    "transformer_options patch names (attn1_patch ... middle_patch, patches_replace)": _check_patch_names,
    "ModelPatcher.object_patches": lambda c: isinstance(c.patcher.object_patches, dict) or pytest.fail(),
    "CFGGuider.model_patcher": lambda c: c.calls[_wrappers().OUTER_SAMPLE][0].model_patcher.model is c.base
        or pytest.fail(),
    "VAE.patcher, VAE.first_stage_model": _check_call(lambda c: c.vae, "patcher", "first_stage_model"),
    "comfy.cli_args.args": lambda c: hasattr(_module("comfy.cli_args")(c).args, "cpu") or pytest.fail(),
    "comfy.cli_args.parser, PerformanceFeature; comfy.options":
        lambda c: (_has(_module("comfy.cli_args")(c), "parser", "PerformanceFeature"),
                   _has(_module("comfy.options")(c), "enable_args_parsing")),
    "comfyui_version.__version__": lambda c: len(_version()) == 3 or pytest.fail(),
    "comfy.model_management.__file__ (ComfyUI's folder for the child)":
        lambda c: (Path(_module("comfy.model_management")(c).__file__).parent.parent / "main.py").is_file()
        or pytest.fail(),
    "comfy.utils.ProgressBar": _check_call(lambda c: _module("comfy.utils")(c).ProgressBar, "update_absolute"),
    "openaimodel.UNetModel":
        lambda c: isinstance(c.unet, _module("comfy.ldm.modules.diffusionmodules.openaimodel")(c).UNetModel)
        or pytest.fail(),
    "openaimodel.forward_timestep_embed, apply_control, timestep_embedding": _check_unet_functions,
    "openaimodel.Downsample, Upsample":
        _check_call(lambda c: _module("comfy.ldm.modules.diffusionmodules.openaimodel")(c), "Downsample", "Upsample"),
    "UNetModel layout (input_blocks, middle_block, output_blocks, time_embed, label_emb, num_classes, "
    "model_channels, out, id_predictor, predict_codebook_ids, default_num_video_frames)": _check_unet_layout,
    "UNetModel._forward's patch points and transformer_options (block, transformer_index, original_shape)":
        _check_forward_patches,
    "comfy.model_patcher.create_model_options_clone":
        lambda c: isinstance(_module("comfy.model_patcher")(c).create_model_options_clone(
            {"transformer_options": {}}), dict) or pytest.fail(),
    "CFGGuider.model_options": lambda c: isinstance(c.calls[_wrappers().OUTER_SAMPLE][0].model_options, dict)
        or pytest.fail(),
    "model_sampling.percent_to_sigma":
        lambda c: float(c.patcher.get_model_object("model_sampling").percent_to_sigma(0.5)) > 0 or pytest.fail(),
    "wrapper call layouts (OUTER_SAMPLE sigmas at 3, DIFFUSION_MODEL options at 5, APPLY_MODEL control at 4)":
        _check_layouts,
    "DiT block lists (Flux, Chroma, HunyuanVideo, WanModel, QwenImageTransformer2DModel, MMDiT, LTXVModel)":
        _check_dit_lists,
    'patches_replace["dit"] block protocol (img, txt, transformer_options, original_block)': _check_dit_lists,
    "WanModel VACE's vace_blocks":
        lambda c: "self.vace_blocks" in _source(_module("comfy.ldm.wan.model")(c).VaceWanModel.__init__)
        or pytest.fail(),
    'transformer_options["patches"]["double_block"]': _check_double_block_patch,
    "transformer_options context_window.index_list": _check_context_window,
    "ModelPatcher.backup (entries of weight, inplace_update)": _check_backup,
    "ModelPatcher.patches": lambda c: isinstance(c.patcher.patches, dict) or pytest.fail(),
    "ModelPatcher.patches_uuid (written)": lambda c: c.patcher.clone().patches_uuid == c.patcher.patches_uuid
        or pytest.fail(),
    "ModelPatcher.patch_weight_to_device, unpatch_model, offload_device": _check_patch_methods,
    "BaseModel.current_weight_patches_uuid (Swap Weights)":
        _check_call(lambda c: c.base, "current_weight_patches_uuid"),
    "cast modules' comfy_patched_weights": _check_patched_weights_flag,
    "comfy.utils.get_attr, copy_to_param": _check_utils,
    "comfy.model_patcher.get_key_weight": _check_key_weight,
    "comfy.model_detection.unet_prefix_from_state_dict": _check_prefix,
    'BaseModel state-dict prefix "diffusion_model."':
        lambda c: all(k.startswith("diffusion_model.") for k in c.base.state_dict()
                      if k.split(".")[0] == "diffusion_model") and any(k.startswith("diffusion_model.")
                                                                     for k in c.base.state_dict()) or pytest.fail(),
    "BaseModel.model_type, model_config (model_type(), sampling_settings)": _check_model_type,
    "ModelPatcher.cached_patcher_init (0.33)": _check_cached_init,
    "ModelPatcher.is_dynamic, get_non_dynamic_delegate, clone(disable_dynamic=True) (0.33)": _check_dynamic,
    "BaseModel.current_patcher": _check_current_patcher,
    "comfy.model_management.throw_exception_if_processing_interrupted":
        _check_call(lambda c: _module("comfy.model_management")(c), "throw_exception_if_processing_interrupted"),
    "folder_paths.get_temp_directory, get_filename_list, get_full_path": _check_folder_paths,
    "loader nodes' inputs in the prompt (UNETLoader.unet_name, CheckpointLoaderSimple.ckpt_name)":
        _check_loader_inputs,
    "comfy_execution.utils.get_executing_context":
        _check_call(lambda c: _module("comfy_execution.utils")(c), "get_executing_context"),
    "comfy.model_management.processing_interrupted, InterruptProcessingException, interrupt_current_processing":
        _check_call(lambda c: _module("comfy.model_management")(c), "processing_interrupted",
                    "InterruptProcessingException", "interrupt_current_processing"),
    "comfy.sd.load_diffusion_model, load_checkpoint_guess_config":
        _check_call(lambda c: _module("comfy.sd")(c), "load_diffusion_model", "load_checkpoint_guess_config"),
    "comfy.sample.sample, prepare_noise; model_management.get_torch_device":
        lambda c: (_has(_module("comfy.sample")(c), "sample", "prepare_noise"),
                   _has(_module("comfy.model_management")(c), "get_torch_device")),
    "BaseModel.model_config.unet_config, latent_format.latent_channels":
        lambda c: (isinstance(c.base.model_config.unet_config, dict) and c.base.latent_format.latent_channels == 4)
        or pytest.fail(),
    "app.rootGraph / app.graph, graph.getNodeById, node.subgraph": _check_web(("rootGraph", "getNodeById", "subgraph")),
    "LiteGraph.vueNodesMode (window.LiteGraph or comfyAPI.litegraph)": _check_web(("vueNodesMode", "comfyAPI")),
    "widget.triggerDraw (Nodes 2.0)": _check_web(("triggerDraw",)),
    "app.extensions (registered twice guard)": _check_web(("extensions",)),
    "app.extensionManager.registerSidebarTab, registerCommand": _check_web(("registerSidebarTab", "registerCommand")),
}


def _wrappers():
    import comfy.patcher_extension

    return comfy.patcher_extension.WrappersMP


@pytest.fixture(scope="module")
def context(comfy_nodes):
    return Context(comfy_nodes)


def test_every_name_has_a_check(accel_pack):
    assert set(CHECKS) == set(accel_pack.accel.comfy_names.NAMES)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_name_exists_on_this_comfyui(context, name):
    """Each listed name, with the shape the pack expects, on the ComfyUI under test."""
    CHECKS[name](context)


# -- a missing name: its warning, and a pass-through ----------------------------------------------------------
PERCENT = "model_sampling.percent_to_sigma"


@pytest.fixture(scope="module")
def unet(comfy_nodes):
    (model,) = comfy_nodes.UNETLoader().load_unet(SD15, "default")
    return model


def _without_percent_to_sigma(model):
    """A clone whose model_sampling (a copy, object-patched in: nothing else changes) has no callable
    percent_to_sigma, as a ComfyUI that renamed it would give; ComfyUI's own sampler never calls it."""
    clone = model.clone()
    sampling = copy.copy(model.get_model_object("model_sampling"))
    sampling.percent_to_sigma = None  # on this instance only
    clone.add_object_patch("model_sampling", sampling)
    return clone


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def _deepcache_runs(pack) -> int:
    return sum(e["feature"] == "deepcache" and e["action"] == "run" for e in pack.accel.telemetry.snapshot()["events"])


def test_a_missing_name_in_a_run_warns_and_runs_in_full(accel_pack, unet, caplog):
    """DeepCache applied, then another node replaces the model's sampling by one without percent_to_sigma: the run
    runs in full, as without DeepCache, with one warning naming the name and ComfyUI's version (before the guard:
    TypeError inside the sampling run)."""
    import deepcache_runs

    names = accel_pack.accel.comfy_names
    names._warned.discard(PERCENT)
    cached = deepcache_runs.deepcache(accel_pack, unet, interval=2)
    eager = deepcache_runs.sample(_without_percent_to_sigma(unet), steps=3)
    runs = _deepcache_runs(accel_pack)
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = deepcache_runs.sample(_without_percent_to_sigma(cached), steps=3)
        deepcache_runs.sample(_without_percent_to_sigma(cached), steps=1)
    assert torch.equal(out, eager), "the run did not pass through: DeepCache changed the output"
    assert _deepcache_runs(accel_pack) == runs, "a DeepCache run took place"
    said = _warnings(caplog, PERCENT)
    assert len(said) == 1 and names.comfyui_version() in said[0] and "docs/comfyui_compat.md" in said[0], said


def test_a_missing_name_at_the_node_passes_the_model_through(accel_pack, unet, caplog):
    import deepcache_runs

    names = accel_pack.accel.comfy_names
    names._warned.discard(PERCENT)
    model = _without_percent_to_sigma(unet)
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = deepcache_runs.deepcache(accel_pack, model, interval=3)
    assert out.model is model.model and not out.get_wrappers(_wrappers().DIFFUSION_MODEL, "accel_deepcache")
    events = accel_pack.accel.telemetry.snapshot()["events"]
    assert events[-1]["feature"] == "deepcache" and events[-1]["action"] == "unsupported", events[-1]
    assert PERCENT in events[-1]["reason"]
    assert _warnings(caplog, PERCENT) and _warnings(caplog, "passes through unchanged")
    assert torch.equal(deepcache_runs.sample(out, steps=2), deepcache_runs.sample(model, steps=2))


# -- after 0.33: an object patch ("config" patches), clone()'s own semantics, a context manager around the sampler
def _object_patched(model, every_block: bool = True):
    """A clone with a real object patch inside each repeated block (or the first only): the block's first
    submodule that holds weights, replaced by a copy with halved weights (another result, the same block kind),
    under a key no node of ComfyUI's uses, as 0.38's "config" patches replace a configurable submodule."""
    clone = model.clone()
    paths = []
    for path, block in _block_paths(model.get_model_object("diffusion_model")):
        name, module = next((n, m) for n, m in block.named_modules() if n and list(m.parameters(recurse=False)))
        paths.append(f"{path}.{name}")
        replacement = copy.deepcopy(module)
        with torch.no_grad():
            for param in replacement.parameters():
                param.mul_(0.5)
        clone.add_object_patch(f"diffusion_model.{path}.{name}", replacement)
        if not every_block:
            break
    return clone, paths


def _block_paths(diffusion_model):
    """The UNet's outermost ResBlocks and SpatialTransformers (what Compile Model compiles), by path."""
    found = []
    for path, module in diffusion_model.named_modules():
        if type(module).__name__ in ("ResBlock", "SpatialTransformer") and not any(
                path.startswith(p + ".") for p, _ in found):
            found.append((path, module))
    return found


def test_object_patch_inside_blocks_runs_those_blocks_eagerly(accel_pack, engine, unet, caplog):
    """Compile Model on a model whose every block holds another node's object patch: no block compiles (Dynamo's
    frame counter stays), the output is the patched model's eager one exactly, and one warning names the patches
    (before: the blocks compiled around the patched modules, unwarned)."""
    from compile_helpers import dynamo_frames

    import deepcache_runs

    patched, paths = _object_patched(unet)
    eager = deepcache_runs.sample(patched, steps=2)
    assert not torch.equal(eager, deepcache_runs.sample(unet, steps=2)), "the object patch changes nothing"
    compiled = engine.compile_model(patched, engine.CompileOptions(choose="always compiled", backend="eager"))
    frames = dynamo_frames()
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = deepcache_runs.sample(compiled, steps=2)
        deepcache_runs.sample(compiled, steps=1)
    assert dynamo_frames() == frames, "a block with another node's object patch was compiled"
    assert torch.equal(out, eager)
    said = _warnings(caplog, "object patches")
    assert len(said) == 1 and f"diffusion_model.{paths[0]}" in said[0] and f"{len(paths)} blocks" in said[0], said
    reasons = {reason for record in engine.model_record.records_of(compiled.model) for entry in record.entries
               for reason in entry.eager_calls}
    assert any(r.startswith("another node's object patch of diffusion_model.") for r in reasons), reasons
    # the run over, nothing of it stays: the unpatched model's calls are not held eager
    assert not accel_pack.accel.compile.object_patches.patched_paths(unet.model)


def test_object_patches_outside_the_blocks_are_left_alone(accel_pack):
    object_patches = accel_pack.accel.compile.object_patches
    assert object_patches.reason("input_blocks.1.0", ("input_blocks.1.0.in_layers.2",))
    assert object_patches.reason("input_blocks.1.0", ("input_blocks",))  # a container holding the block
    assert object_patches.reason("input_blocks.1.0", ("input_blocks.10.0",)) is None
    assert object_patches.reason("", ("out.2",))  # the whole model: any patch inside it
    assert object_patches.reason("input_blocks.1.0", ()) is None


class FastDiskPatcher:
    """Mixed into a real ModelPatcher's class: the flag 0.38's ModelPatcher takes and its clone() keeps
    (`fast_disk`). A node that built its patcher by hand would lose the class and the flag."""

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        n.fast_disk = self.fast_disk
        return n


def _fast_disk(patcher):
    out = patcher.clone()
    out.__class__ = type("FastDisk" + type(patcher).__name__, (FastDiskPatcher, type(patcher)), {})
    out.fast_disk = True
    return out


def test_every_node_returns_a_clone_of_its_input(accel_pack, engine, unet, comfy_nodes):
    import deepcache_runs

    from compile_helpers import SMALL_B

    import folder_paths

    model = _fast_disk(unet)
    outputs = {
        "Compile Model": engine.compile_model(model, engine.CompileOptions()),
        "DeepCache": deepcache_runs.deepcache(accel_pack, model),
        "DeepCache passing through": deepcache_runs.deepcache(accel_pack, _fast_disk(_without_percent_to_sigma(unet))),
        "Swap Weights": accel_pack.accel.weight_swap.swap_weights(
            model, accel_pack.accel.weight_swap.WeightsFile(folder_paths.get_full_path("diffusion_models", SMALL_B))),
    }
    for name, out in outputs.items():
        assert isinstance(out, FastDiskPatcher) and out.fast_disk is True, f"{name} rebuilt the patcher by hand"
        assert out.model is unet.model and out is not model
    (vae,) = comfy_nodes.VAELoader().load_vae("taesd")
    vae.patcher = _fast_disk(vae.patcher)
    compiled = engine.compile_vae(vae, engine.CompileOptions())
    assert isinstance(compiled.patcher, FastDiskPatcher) and compiled.patcher.fast_disk is True
    assert compiled.patcher is not vae.patcher
    for path in [*ROOT.glob("accel/**/*.py"), *ROOT.glob("nodes/*.py")]:
        assert not re.search(r"\bModelPatcher\w*\(", path.read_text()), f"{path} builds a ModelPatcher by hand"


def test_wrappers_hold_with_a_context_manager_around_the_sampler(accel_pack, engine, unet):
    """As 0.38's outer_sample runs inner_sample inside comfy.weight_cache.sampling_weight_cache: a context manager
    of our own around the sampler (a public SAMPLER_SAMPLE wrapper) under Compile Model and DeepCache. Their
    OUTER_SAMPLE wrappers arm (DeepCache reuses steps) and drop their state after a good run and after one the
    context manager interrupts."""
    import comfy.model_management as mm

    import deepcache_runs

    events = []

    @contextlib.contextmanager
    def weight_cache(interrupt: bool):
        events.append("enter")
        try:
            yield
        finally:
            events.append("exit")
        if interrupt:
            raise mm.InterruptProcessingException()

    def around_sampler(interrupt):
        def wrapper(executor, *args, **kwargs):
            with weight_cache(interrupt):
                return executor(*args, **kwargs)
        return wrapper

    patched, _ = _object_patched(unet)  # every block eager: no compile, Compile Model's wrappers all the same
    stack = deepcache_runs.deepcache(accel_pack, engine.compile_model(
        patched, engine.CompileOptions(choose="always compiled", backend="eager")), interval=2)
    plain = deepcache_runs.sample(stack, steps=3)
    gate = accel_pack.accel.compile.background.IDLE_GATE
    for interrupt in (False, True):
        model = stack.clone()
        model.add_wrapper_with_key(_wrappers().SAMPLER_SAMPLE, "test_weight_cache", around_sampler(interrupt))
        runs = _deepcache_runs(accel_pack)
        with pytest.raises(mm.InterruptProcessingException) if interrupt else contextlib.nullcontext():
            out = deepcache_runs.sample(model, steps=3)
        report = [e for e in accel_pack.accel.telemetry.snapshot()["events"]
                  if e["feature"] == "deepcache" and e["action"] == "run"][-1]
        assert _deepcache_runs(accel_pack) == runs + 1 and events[-2:] == ["enter", "exit"]
        assert report["status"] == ("interrupted" if interrupt else "completed"), report
        if not interrupt:
            assert report["reused_steps"] > 0 and torch.equal(out, plain)
        assert not gate.sampling, "Compile Model's sampling-run mark stayed after the run"
        assert not accel_pack.accel.compile.object_patches.patched_paths(unet.model)
        assert "accel_deepcache_run" not in model.model_options["transformer_options"]
