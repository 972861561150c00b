"""The check that runs before anything changes: do the new weights fit this model's architecture?

Same keys and same shapes are required; dtypes may differ (each tensor is converted as it is copied, the same
conversion ComfyUI's loader makes). The error names the first mismatching keys and what to do instead.
"""
from __future__ import annotations

from .sources import MODEL_PREFIX

SHOW = 3  # mismatching keys named in an error


def model_shapes(patcher) -> dict[str, tuple[int, ...]]:
    state = patcher.model.diffusion_model.state_dict(keep_vars=True)
    return {MODEL_PREFIX + k: tuple(v.shape) for k, v in state.items()}


def _count(keys, one: str, many: str) -> str:
    return f"{len(keys)} {one if len(keys) == 1 else many}"


def _first(keys, describe=str) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - SHOW} more" if len(keys) > SHOW else ""
    return ", ".join(describe(k) for k in keys[:SHOW]) + more


def _check_sampling(source, patcher) -> None:
    """Raise ValueError when the file's own keys tell ComfyUI's checkpoint loader to sample it otherwise than this
    model samples (a v-prediction checkpoint into an eps model, zero terminal SNR, EDM): its weights here would
    give another picture than the file itself, as Swap Weights copies weights only. Asked of the model's own
    config (a copy: ComfyUI's model_type writes the sigmas it reads into the config's sampling settings). A
    weights_model that samples otherwise is refused the same way."""
    model = patcher.model
    other = getattr(source, "patcher", None)  # a weights_model: how its own loader made it sample
    if other is not None and other.model.model_type != model.model_type:
        raise ValueError(f"Swap Weights: {source.label} samples as {other.model.model_type.name} and this model as "
                         f"{model.model_type.name}: its weights in this model would give another picture than it "
                         "gives itself. Sample that model itself instead.")
    markers = getattr(source, "model_type_markers", ())
    if not markers:
        return
    from safetensors import safe_open

    config = _copy_of_config(model.model_config)
    with safe_open(source.path, "pt") as found:
        state = {key: found.get_tensor(key) for key in markers}
    try:
        model_type = config.model_type(state, prefix="")
    except Exception:  # noqa: BLE001  (a family whose rule reads weights: nothing more to tell here)
        return
    if model_type != model.model_type or config.sampling_settings != _sampling_settings(model.model_config):
        raise ValueError(
            f"Swap Weights: {source.label} samples as {model_type.name} ({', '.join(markers)} in the file) and "
            f"this model as {model.model_type.name}"
            + ("" if model_type != model.model_type else " with other sampling settings")
            + ": its weights in this model would give another picture than the file itself. Load it with its "
            "own loader (Load Checkpoint) instead.")


def _sampling_settings(config) -> dict:
    return dict(getattr(config, "sampling_settings", None) or {})


def _copy_of_config(config):
    """A shallow copy of a model config whose sampling settings can be written without touching the model's.
    Not copy.copy: since 0.33 a config's __getattr__ answers every missing name with None (and a warning), so
    copy's lookup of __setstate__ finds None and calls it."""
    copied = object.__new__(type(config))
    copied.__dict__.update(vars(config))
    copied.sampling_settings = _sampling_settings(config)
    return copied


# Weight storage Swap Weights cannot write, by the tensor type that holds it: a plain copy into it is dropped
# (ComfyUI-GGUF's GGMLTensor ignores copy_ with a warning) or writes unscaled values (ComfyUI's QuantizedTensor).
QUANTIZED_TENSOR_FORMATS = {
    "GGMLTensor": "GGUF (quantized weights of ComfyUI-GGUF's Unet Loader (GGUF))",
    "QuantizedTensor": "fp8 scaled / quantized (ComfyUI's quantized weights, e.g. a scaled_fp8 checkpoint)",
}


def stored_format(patcher) -> str | None:
    """The quantized format the model keeps its weights in, named for a person, or None for plain tensors (of any
    dtype: fp8 weight_dtype weights are plain fp8 tensors, copied with the same conversion ComfyUI's loader
    makes). Checked before anything else: such a model's keys (GGUF's, a scaled checkpoint's scale tensors) would
    otherwise be refused as another architecture."""
    import torch
    from comfy.model_patcher import get_key_weight

    for name, param in patcher.model.diffusion_model.named_parameters():
        kind = type(param)
        if kind not in (torch.Tensor, torch.nn.Parameter):
            return QUANTIZED_TENSOR_FORMATS.get(kind.__name__, f"quantized ({kind.__name__} tensors)")
        _, set_func, convert_func = get_key_weight(patcher.model, MODEL_PREFIX + name)
        if set_func is not None or convert_func is not None:
            return "fp8 scaled (ComfyUI's scaled_fp8 format, or another converted weight format)"
    return None


def check_fits(source, patcher) -> None:
    """Raise ValueError unless `source` has exactly the model's parameters, with the same shapes, and the model
    keeps its weights as plain tensors."""
    stored = stored_format(patcher)
    if stored:
        raise ValueError(f"Swap Weights: this model keeps its weights in the {stored} format, which Swap Weights "
                         "cannot write (it copies plain tensors, of any dtype). Load the model from a safetensors "
                         "file with UNETLoader (weight_dtype default, fp8_e4m3fn or fp8_e5m2) to swap its weights, or "
                         "load the other file with its own loader instead.")
    shapes = model_shapes(patcher)
    params = {MODEL_PREFIX + k for k, _ in patcher.model.diffusion_model.named_parameters()}
    source_keys = set(source.keys())
    problems = []
    missing = params - source_keys
    if missing:
        told = _count(missing, "of the model's weights is", "of the model's weights are")
        problems.append(f"{told} not in it ({_first(missing)})")
    unexpected = source_keys - set(shapes)
    if unexpected:
        told = _count(unexpected, "of its tensors is", "of its tensors are")
        problems.append(f"{told} not in the model ({_first(unexpected)})")
    reshaped = {k for k in source_keys & set(shapes) if tuple(source.shape(k)) != shapes[k]}
    if reshaped:
        told = _count(reshaped, "tensor has", "tensors have")
        shapes_of = lambda k: f"{k}: {list(source.shape(k))} here, {list(shapes[k])} in the model"  # noqa: E731
        problems.append(f"{told} another shape ({_first(reshaped, shapes_of)})")
    if problems:
        raise ValueError(
            f"Swap Weights: {source.label} does not fit this model ({type(patcher.model).__name__}, "
            f"{len(params)} weights): " + "; ".join(problems) + ". Pick a file of the same architecture as the "
            "model (the same model family and size), or load the other file with its own loader instead.")
    source.check_readable()
    _check_sampling(source, patcher)
