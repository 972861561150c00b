"""ComfyUI-Accel: Compile Model, DeepCache and Swap Weights nodes for ComfyUI.

ComfyUI imports this file from custom_nodes/. It only registers node classes, the web extension and an
HTTP route: no torch.compile, no model work, no change to torch, transformers or ComfyUI globals.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from .nodes.routes import register_routes

WEB_DIRECTORY = "./web"

register_routes()

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
