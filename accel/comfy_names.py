"""Every ComfyUI name the pack reaches beyond ComfyUI's public mechanisms, and what happens when one is gone.

The public mechanisms (ModelPatcher's `clone`, wrappers, callbacks, attachments, object patches, `model_options`
and its setters, `get_model_object`, `PromptServer`) need no entry. Everything else the pack reads or writes in
ComfyUI (a module's function, a class's or a model's attribute, the layout of a block list or of a call's
arguments) is a NAMES entry: what a newer ComfyUI may rename without notice. docs/comfyui_compat.md says for each
where it is used, what the pack does without it, and on which ComfyUI versions it was checked;
tests/test_comfyui_compat.py checks each on the running ComfyUI and that this list, the doc and the source agree.

Where a name is missing or changed, the feature that needs it warns once (`warn_missing`: the name, ComfyUI's
version and what the pack does instead) and passes the model through: it runs as without the pack's feature,
never half-accelerated, never raising inside a sampling run.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass

log = logging.getLogger("comfyui_accel")


@dataclass(frozen=True)
class PrivateName:
    name: str  # as docs/comfyui_compat.md names it
    tokens: tuple[str, ...]  # how the pack's source spells it (the test finds each in every one of `files`)
    files: tuple[str, ...]  # where the pack uses it, relative to the pack's folder
    absent: str  # what the pack does where ComfyUI lacks it (the warning's last words)


def _n(name: str, tokens, files, absent: str) -> PrivateName:
    tokens = (tokens,) if isinstance(tokens, str) else tuple(tokens)
    files = (files,) if isinstance(files, str) else tuple(files)
    return PrivateName(name, tokens, files, absent)


_ATTENTION = "accel/compile/attention.py"
_BLOCKS = "accel/compile/blocks.py"
_PATCHER = "accel/compile/patcher.py"
_OBJECT_PATCHES = "accel/compile/object_patches.py"
_RECORD = "accel/compile/model_record.py"
_PRECOMPILED = "accel/compile/precompiled.py"
_SAVING = "accel/compile/child/saving.py"
_UNET = "accel/deepcache/unet_paths.py"
_DIT = "accel/deepcache/dit_paths.py"
_FAMILIES = "accel/families.py"
_RUNTIME = "accel/deepcache/runtime.py"
_RUN_STATE = "accel/deepcache/run_state.py"
_LEDGER = "accel/weight_swap/ledger.py"
_SWAP = "accel/weight_swap/patcher.py"
_VALIDATE = "accel/weight_swap/validate.py"
_SOURCES = "accel/weight_swap/sources.py"
_ORIGIN = "accel/weight_swap/origin.py"
_SWAP_NODE = "nodes/swap_weights.py"
_STATUS = "nodes/status.py"
_IMPORT = "accel/comfy_import.py"
_WORKER = "accel/compile/background/worker.py"
_CLI = "accel/precompile.py"
_VAE = "accel/compile/vae.py"
_JS = "web/accel.js"
_PANEL = "web/accel_panel.js"

EAGER_BLOCKS = "Compile Model runs the model's blocks eagerly"
DEEPCACHE_OFF = "DeepCache passes the model through unchanged (every step runs in full)"
SWAP_REFUSED = "Swap Weights refuses the swap at the node, naming the name (a model left unswapped would be " \
               "another picture than the one asked for)"

NAMES: dict[str, PrivateName] = {n.name: n for n in (
    # -- Compile Model ---------------------------------------------------------------------------------------
    _n("comfy.ldm.modules.attention.optimized_attention", "optimized_attention", (_ATTENTION, _BLOCKS, _PRECOMPILED),
       "every block call counts as under another node's attention swap: " + EAGER_BLOCKS),
    _n("comfy.ldm.modules.attention.optimized_attention_masked", "optimized_attention_masked",
       (_BLOCKS, _PRECOMPILED), "as optimized_attention: " + EAGER_BLOCKS),
    _n("comfy.ldm.modules.attention.attention_pytorch", "attention_pytorch", _ATTENTION,
       "compiled blocks keep ComfyUI's own attention (on the CPU the sub-quadratic one: more graphs, same result)"),
    _n("comfy.ldm.modules.attention.attention_sub_quad, attention_split (by __name__)",
       ("attention_sub_quad", "attention_split"), _ATTENTION,
       "a renamed graph-breaking attention is kept inside compiled blocks (more graphs, same result)"),
    _n('transformer_options["optimized_attention_override"]', "optimized_attention_override", (_ATTENTION, _BLOCKS),
       "ComfyUI ignoring it, compiled blocks run ComfyUI's attention (more graphs, same result)"),
    _n("BaseModel.diffusion_model", "diffusion_model", (_RECORD, _PATCHER, _VALIDATE, "accel/weight_swap/model_source.py"),
       "Compile Model runs the model eagerly; Swap Weights refuses it at the node"),
    _n("BaseModel.model_lowvram", "model_lowvram", _PATCHER,
       "every block's weights are checked at each call, as after a partial load (correct, a little slower)"),
    _n("BaseModel.current_weight_patches_uuid, model_loaded_weight_memory, lowvram_patch_counter",
       ("current_weight_patches_uuid", "model_loaded_weight_memory", "lowvram_patch_counter"), _RECORD,
       "requires_grad is settled once, not at each load (a later weight patch may recompile once)"),
    _n("openaimodel.ResBlock, VideoResBlock; attention.SpatialTransformer, SpatialVideoTransformer (class names)",
       ("ResBlock", "SpatialTransformer", "VideoResBlock", "SpatialVideoTransformer"), (_FAMILIES, _UNET),
       "a UNet's blocks are not found: Compile Model warns that it found no blocks and the model runs eagerly"),
    _n("block forwards' transformer_options parameter", "transformer_options", _BLOCKS,
       "a block whose forward names it otherwise gets the call's own options (other nodes' patches kept)"),
    _n("diffusion model's _forward (scope whole model)", "_forward", _BLOCKS,
       "whole-model scope compiles `forward` instead (other nodes' DIFFUSION_MODEL wrappers traced with it)"),
    _n("cast modules' weight_function, bias_function (LoRA on a partial load)", ("weight_function", "bias_function"),
       _BLOCKS, "such blocks are compiled with ComfyUI's per-call LoRA functions (recompiles per weight, same result)"),
    _n("<param>_comfy_model_dtype (0.33's load-time dtype records)", "_comfy_model_dtype", _SAVING,
       "nothing set aside; a record under another name makes torch refuse the saved graph: the kind loads "
       "through Dynamo (logged)"),
    _n("transformer_options keys the sampler sets", ("cond_or_uncond", "sample_sigmas", "uuids",
                                                      "prefetch_dynamic_vbars"), (_BLOCKS, _RUN_STATE),
       "a new key makes whole-model calls eager; DeepCache keys its features by cond_or_uncond"),
    _n("transformer_options patch names (attn1_patch ... middle_patch, patches_replace)",
       ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch", "patches_replace"),
       _BLOCKS, "a patch under a new name is not seen: " + EAGER_BLOCKS + " only for the names it knows"),
    _n("ModelPatcher.object_patches", "object_patches", (_VAE, _OBJECT_PATCHES),
       "another node's object patch inside a block is not seen (Compile Model warns that it cannot check them)"),
    _n("CFGGuider.model_patcher", "model_patcher", (_OBJECT_PATCHES, _RUNTIME),
       "Compile Model cannot check object patches (warned); DeepCache runs the run in full"),
    _n("VAE.patcher, VAE.first_stage_model", ("patcher", "first_stage_model"), _VAE,
       "Compile VAE returns the VAE unchanged"),
    _n("comfy.cli_args.args", "args", (_PRECOMPILED, _WORKER, _IMPORT),
       "raises at import: ComfyUI itself cannot start without it"),
    _n("comfy.cli_args.parser, PerformanceFeature; comfy.options", ("parser", "PerformanceFeature", "comfy.options"),
       _IMPORT, "`python -m accel precompile` and the compile child cannot parse ComfyUI's flags (they fail, "
                "the prompt's blocks run eagerly)"),
    _n("comfyui_version.__version__", "comfyui_version.__version__", (_PRECOMPILED, "accel/comfy_names.py"),
       'the version reads "unknown" (saved graphs are keyed with it)'),
    _n("comfy.model_management.__file__ (ComfyUI's folder for the child)", "comfy.model_management.__file__",
       _WORKER, "the compile child cannot start: kinds compile in ComfyUI's process"),
    _n("comfy.utils.ProgressBar", "ProgressBar", (_PATCHER, _LEDGER, _STATUS), "no progress bar"),
    # -- DeepCache -------------------------------------------------------------------------------------------
    _n("openaimodel.UNetModel", "UNetModel", _UNET, DEEPCACHE_OFF),
    _n("openaimodel.forward_timestep_embed, apply_control, timestep_embedding",
       ("forward_timestep_embed", "apply_control", "timestep_embedding"), _UNET, DEEPCACHE_OFF),
    _n("openaimodel.Downsample, Upsample", ("Downsample", "Upsample"), _UNET,
       'the compute estimate reads "unknown"'),
    _n("UNetModel layout (input_blocks, middle_block, output_blocks, time_embed, label_emb, num_classes, "
       "model_channels, out, id_predictor, predict_codebook_ids, default_num_video_frames)",
       ("input_blocks", "middle_block", "output_blocks", "time_embed", "label_emb", "num_classes", "model_channels",
        "out", "id_predictor", "predict_codebook_ids", "default_num_video_frames"), _UNET, DEEPCACHE_OFF),
    _n("UNetModel._forward's patch points and transformer_options (block, transformer_index, original_shape)",
       ("emb_patch", "input_block_patch", "input_block_patch_after_skip", "output_block_patch", "transformer_index",
        "original_shape"), _UNET, "a new patch point in the deep part is skipped on reused steps, as the deep "
                                  "part is (the doc says which are)"),
    _n("comfy.model_patcher.create_model_options_clone", "create_model_options_clone", _RUNTIME, DEEPCACHE_OFF),
    _n("CFGGuider.model_options", "model_options", _RUNTIME, DEEPCACHE_OFF),
    _n("model_sampling.percent_to_sigma", "percent_to_sigma", _RUN_STATE, DEEPCACHE_OFF),
    _n("wrapper call layouts (OUTER_SAMPLE sigmas at 3, DIFFUSION_MODEL options at 5, APPLY_MODEL control at 4)",
       ("args[3]", "args[5]", "args[4]"), _RUNTIME, "the call runs in full"),
    _n("DiT block lists (Flux, Chroma, HunyuanVideo, WanModel, QwenImageTransformer2DModel, MMDiT, LTXVModel)",
       ("double_blocks", "single_blocks", "transformer_blocks", "joint_blocks", '"blocks"'), _FAMILIES,
       DEEPCACHE_OFF),
    _n('patches_replace["dit"] block protocol (img, txt, transformer_options, original_block)',
       ('"dit"', '"img"', '"txt"', '"original_block"'), (_DIT, _RUNTIME, _FAMILIES),
       "a loop that stops calling it never reuses: every step runs in full (the run's report says so)"),
    _n("WanModel VACE's vace_blocks", "vace_blocks", _RUNTIME,
       "a VACE model would be cached (its hints added twice on reused steps): the family test fails first"),
    _n('transformer_options["patches"]["double_block"]', '"double_block"', _RUNTIME,
       "a model whose ControlNet-style patch runs after every block under another name would be reused"),
    _n("transformer_options context_window.index_list", ("context_window", "index_list"), _RUN_STATE,
       "context windows share one key: their calls run in full"),
    # -- Swap Weights ----------------------------------------------------------------------------------------
    _n("ModelPatcher.backup (entries of weight, inplace_update)", ("backup", "inplace_update"), (_LEDGER,), SWAP_REFUSED),
    _n("ModelPatcher.patches", "patches", _LEDGER, SWAP_REFUSED),
    _n("ModelPatcher.patches_uuid (written)", "patches_uuid", (_LEDGER, _SWAP), SWAP_REFUSED),
    _n("ModelPatcher.patch_weight_to_device, unpatch_model, offload_device",
       ("patch_weight_to_device", "unpatch_model", "offload_device"), _LEDGER, SWAP_REFUSED),
    _n("BaseModel.current_weight_patches_uuid (Swap Weights)", "current_weight_patches_uuid", _LEDGER, SWAP_REFUSED),
    _n("cast modules' comfy_patched_weights", "comfy_patched_weights", _LEDGER,
       "patches are re-applied only where ComfyUI's backup says it patched"),
    _n("comfy.utils.get_attr, copy_to_param", ("get_attr", "copy_to_param"), _LEDGER, SWAP_REFUSED),
    _n("comfy.model_patcher.get_key_weight", "get_key_weight", _VALIDATE, SWAP_REFUSED),
    _n("comfy.model_detection.unet_prefix_from_state_dict", "unet_prefix_from_state_dict", _SOURCES, SWAP_REFUSED),
    _n('BaseModel state-dict prefix "diffusion_model."', '"diffusion_model."', _SOURCES, SWAP_REFUSED),
    _n("BaseModel.model_type, model_config (model_type(), sampling_settings)",
       ("model_type", "model_config", "sampling_settings"), _VALIDATE, SWAP_REFUSED),
    _n("ModelPatcher.cached_patcher_init (0.33)", "cached_patcher_init", _ORIGIN,
       "the loader's file is not known: the originals are spilled to ComfyUI's temp folder as they are replaced"),
    _n("ModelPatcher.is_dynamic, get_non_dynamic_delegate, clone(disable_dynamic=True) (0.33)",
       ("is_dynamic", "get_non_dynamic_delegate", "disable_dynamic"), "accel/dynamic_vram.py",
       "absent on 0.3.75, where no model is dynamic: nothing to do (docs/dynamic_vram.md)"),
    _n("BaseModel.current_patcher", "current_patcher", "accel/dynamic_vram.py",
       "a model call's patcher is not known: it counts as not dynamic (docs/dynamic_vram.md)"),
    _n("comfy.model_management.throw_exception_if_processing_interrupted", "throw_exception_if_processing_interrupted",
       _LEDGER, SWAP_REFUSED),
    _n("folder_paths.get_temp_directory, get_filename_list, get_full_path",
       ("get_temp_directory", "get_filename_list", "get_full_path"), (_ORIGIN, _SWAP_NODE, _CLI), SWAP_REFUSED),
    _n("loader nodes' inputs in the prompt (UNETLoader.unet_name, CheckpointLoaderSimple.ckpt_name)",
       ("unet_name", "ckpt_name"), _SWAP_NODE, "no hint of the model's file: its originals are spilled to disk"),
    # -- the nodes' status and progress ------------------------------------------------------------------------
    _n("comfy_execution.utils.get_executing_context", "get_executing_context", _STATUS,
       "no progress bar on the waiting node"),
    _n("comfy.model_management.processing_interrupted, InterruptProcessingException, interrupt_current_processing",
       ("processing_interrupted", "InterruptProcessingException", "interrupt_current_processing"), _STATUS,
       "no progress bar on the waiting node"),
    # -- python -m accel precompile (a command, never inside a prompt) ------------------------------------------
    _n("comfy.sd.load_diffusion_model, load_checkpoint_guess_config", ("load_diffusion_model",
                                                                      "load_checkpoint_guess_config"), _CLI,
       "the command fails, naming the model it could not load"),
    _n("comfy.sample.sample, prepare_noise; model_management.get_torch_device",
       ("comfy.sample.sample", "prepare_noise", "get_torch_device"), _CLI, "the command fails"),
    _n("BaseModel.model_config.unet_config, latent_format.latent_channels", ("unet_config", "latent_channels"), _CLI,
       "the command fails"),
    # -- the web UI (ComfyUI's frontend) ------------------------------------------------------------------------
    _n("app.rootGraph / app.graph, graph.getNodeById, node.subgraph", ("rootGraph", "getNodeById", "subgraph"), _JS,
       "no status under the node (optional chaining: nothing raises)"),
    _n("LiteGraph.vueNodesMode (window.LiteGraph or comfyAPI.litegraph)", ("vueNodesMode", "comfyAPI"), _JS,
       "the classic canvas's drawing only"),
    _n("widget.triggerDraw (Nodes 2.0)", "triggerDraw", _JS, "a Nodes 2.0 status draws at the next redraw"),
    _n("app.extensions (registered twice guard)", "app.extensions", (_JS, _PANEL),
       "the extension registers (twice where ComfyUI serves the folder twice)"),
    _n("app.extensionManager.registerSidebarTab, registerCommand", ("registerSidebarTab", "registerCommand"), _PANEL,
       "no Accel panel"),
)}

_warned: set[str] = set()


def comfyui_version() -> str:
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def warn_missing(name: str, detail: str = "") -> None:
    """One warning per name in this process: the name, this ComfyUI's version and what the pack does instead."""
    entry = NAMES[name]
    if name in _warned:
        return
    _warned.add(name)
    log.warning("[Accel] ComfyUI %s has no %s%s, which this pack was written for (docs/comfyui_compat.md): %s.",
                comfyui_version(), name, f" ({detail})" if detail else "", entry.absent)


def attr(obj, attribute: str, name: str, default=None):
    """`obj.<attribute>`, or `default` after warn_missing(name) where obj has none."""
    try:
        return getattr(obj, attribute)
    except AttributeError:
        warn_missing(name, f"{type(obj).__name__}.{attribute}")
        return default


def missing(obj, attributes, name: str) -> list[str]:
    """The `attributes` `obj` lacks (warned once under `name`), [] when it has them all."""
    gone = [a for a in attributes if not hasattr(obj, a)]
    if gone:
        owner = obj.__name__ if isinstance(obj, types.ModuleType) else type(obj).__name__
        warn_missing(name, f"{owner} lacks {', '.join(gone)}")
    return gone
