"""Thin ComfyUI node classes. All engine work lives in `accel/`.

The nodes use ComfyUI's V1 node API (NODE_CLASS_MAPPINGS), which both ComfyUI 0.3.75 and 0.33+ load
the same way; the V3 schema differs between those versions (see ../shared research notes).
"""
from .compile_model import CompileModel, CompileVAE
from .deepcache import DeepCache
from .swap_weights import SwapWeights

NODE_CLASSES = {
    "AccelCompileModel": CompileModel,
    "AccelCompileVAE": CompileVAE,
    "AccelDeepCache": DeepCache,
    "AccelSwapWeights": SwapWeights,
}

NODE_CLASS_MAPPINGS = dict(NODE_CLASSES)
NODE_DISPLAY_NAME_MAPPINGS = {name: cls.DISPLAY_NAME for name, cls in NODE_CLASSES.items()}
