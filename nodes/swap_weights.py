from __future__ import annotations

from ..accel.weight_swap import WeightsFile, file_identity, swap_from_model, swap_weights
from .common import CATEGORY, OWNER_INPUTS, status_owner

NO_FILE = "(use weights_model)"
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
WEIGHT_FOLDERS = ("diffusion_models", "checkpoints")
# Loader nodes whose file is the model's original weights: class_type -> (file input, model folder).
LOADERS = {
    "UNETLoader": ("unet_name", "diffusion_models"),
    "CheckpointLoaderSimple": ("ckpt_name", "checkpoints"),
    "CheckpointLoader": ("ckpt_name", "checkpoints"),
}
MODEL_INPUTS = ("model", "model1")  # the input a MODEL -> MODEL node builds its output on


def weight_files():
    """The safetensors files of ComfyUI's diffusion_models and checkpoints folders, each name once (weights_path
    reads a name found in both from diffusion_models): the only files Swap Weights reads, where the folders also
    list .ckpt, .pt and .bin files, which it would refuse only when the workflow ran."""
    import folder_paths  # ComfyUI's own model folder registry

    names = [name for folder in WEIGHT_FOLDERS for name in folder_paths.get_filename_list(folder)
             if name.lower().endswith(SAFETENSORS_SUFFIXES)]
    return [NO_FILE] + list(dict.fromkeys(names))


def weights_path(name: str) -> str:
    import folder_paths

    for folder in WEIGHT_FOLDERS:
        path = folder_paths.get_full_path(folder, name)
        if path:
            return path
    raise ValueError(f"Swap Weights: {name} is not in ComfyUI's diffusion_models or checkpoints folders.")


def upstream_loader_file(prompt: dict | None, node_id) -> str | None:
    """The file of the loader that the workflow's model input comes from, through MODEL -> MODEL nodes (LoRA
    loaders, Compile Model...). ComfyUI's nodes never change a model's base weights (they patch clones), so this is
    the file the model's original weights can be re-read from instead of being kept in memory. Only a hint: the
    engine checks it against the weights before relying on it."""
    import folder_paths

    node = (prompt or {}).get(str(node_id)) if node_id is not None else None
    for _ in range(64):
        inputs = (node or {}).get("inputs", {})
        link = next((inputs[name] for name in MODEL_INPUTS if isinstance(inputs.get(name), list)), None)
        if not link:
            return None
        node = prompt.get(str(link[0]))
        loader = LOADERS.get((node or {}).get("class_type"))
        if loader:
            name = node.get("inputs", {}).get(loader[0])
            return folder_paths.get_full_path(loader[1], name) if isinstance(name, str) else None
    return None


class SwapWeights:
    DISPLAY_NAME = "Swap Weights (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Gives the model the weights of another file or MODEL of the same architecture while keeping its "
                   "compiled graphs, patches and wrappers. The weights are streamed in, tensor by tensor, when the "
                   "model loads: one weight copy, no recompile, never two models in memory.")
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL", {
                "tooltip": "The model that gets the other weights; its compiled graphs, LoRA and other patches are "
                           "kept."}), "weights_file": (weight_files(), {
                "tooltip": "A checkpoint or diffusion-model file of the same architecture as the model. "
                           "'(use weights_model)' takes the weights from the weights_model input instead."})},
            "optional": {"weights_model": ("MODEL", {
                "tooltip": "Or another MODEL's base weights, without its own LoRA (set weights_file to "
                           "'(use weights_model)')."})},
            "hidden": {"prompt": "PROMPT", **OWNER_INPUTS},
        }

    @classmethod
    def IS_CHANGED(cls, weights_file=NO_FILE, **_):
        """ComfyUI runs the node again when this value changes. A file rewritten under its name (a fine-tune saved
        again) then gets read anew; without it, ComfyUI kept the node's output from the old file, whose reads refuse
        the changed file, at every run until an input changed."""
        if weights_file == NO_FILE:
            return NO_FILE
        try:
            return repr(file_identity(weights_path(weights_file)))
        except (OSError, ValueError):  # the run itself says what is wrong (an exception here would run it always)
            return f"{weights_file}: not found"

    def apply(self, model, weights_file, weights_model=None, prompt=None, unique_id=None, extra_pnginfo=None):
        if weights_file != NO_FILE and weights_model is not None:
            raise ValueError(f"Swap Weights: both weights_file ({weights_file}) and weights_model are given; set "
                             f"weights_file to '{NO_FILE}' to use weights_model, or disconnect weights_model.")
        hints = [upstream_loader_file(prompt, unique_id)]
        owner = status_owner(unique_id, extra_pnginfo)
        if weights_file == NO_FILE:
            if weights_model is None:
                raise ValueError(f"Swap Weights: pick a weights_file, or connect weights_model and keep "
                                 f"'{NO_FILE}'.")
            return (swap_from_model(model, weights_model, hints, owner),)
        return (swap_weights(model, WeightsFile(weights_path(weights_file), label=weights_file), hints, owner),)
