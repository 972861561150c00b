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
    import copy

    from safetensors import safe_open

    config = copy.copy(model.model_config)
    config.sampling_settings = dict(getattr(config, "sampling_settings", {}))
    with safe_open(source.path, "pt") as found:
        state = {key: found.get_tensor(key) for key in markers}
    try:
        model_type = config.model_type(state, prefix="")
    except Exception:  # noqa: BLE001  (a family whose rule reads weights: nothing more to tell here)
        return
    if model_type != model.model_type or config.sampling_settings != getattr(model.model_config,
                                                                              "sampling_settings", {}):
        raise ValueError(
            f"Swap Weights: {source.label} samples as {model_type.name} ({', '.join(markers)} in the file) and "
            f"this model as {model.model_type.name}"
            + ("" if model_type != model.model_type else " with other sampling settings")
            + ": its weights in this model would give another picture than the file itself. Load it with its "
            "own loader (Load Checkpoint) instead.")


def check_fits(source, patcher) -> None:
    """Raise ValueError unless `source` has exactly the model's parameters, with the same shapes."""
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
    # Quantized or otherwise converted weights are stored through their op's set/convert functions; a plain copy
    # would write them wrongly.
    from comfy.model_patcher import get_key_weight

    for key in sorted(source_keys):
        _, set_func, convert_func = get_key_weight(patcher.model, key)
        if set_func is not None or convert_func is not None:
            raise ValueError(f"Swap Weights: {key} is stored in a converted or quantized format (a model loaded "
                             "with a weight dtype such as fp8 scaled); Swap Weights copies plain tensors only. Load "
                             "the model in its default weight dtype.")
