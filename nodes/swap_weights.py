from __future__ import annotations

from .common import CATEGORY, pass_through

NO_FILE = "(use weights_model)"


def weight_files():
    import folder_paths  # ComfyUI's own model folder registry

    return [NO_FILE] + folder_paths.get_filename_list("diffusion_models") + folder_paths.get_filename_list("checkpoints")


class SwapWeights:
    DISPLAY_NAME = "Swap Weights (Accel)"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Gives the model the weights of another file or MODEL of the same architecture while keeping its "
                   "compiled graphs, patches and wrappers.")
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL",), "weights_file": (weight_files(),)},
            "optional": {"weights_model": ("MODEL",)},
        }

    def apply(self, model, weights_file, weights_model=None):
        return (pass_through("swap_weights", self.DISPLAY_NAME, model, weights_file=weights_file,
                             weights_model="connected" if weights_model is not None else None),)
