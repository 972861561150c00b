"""Compile Model on every image model family ComfyUI ships: SDXL, SD3, Chroma, Qwen-Image and Lumina 2, each a
generated model (tools/family_models.py) loaded by ComfyUI's own UNETLoader (detected as the family's model
class) and sampled by its own sampler with conditioning tensors of the family's widths (tools/families.py).
What is checked per family: tests/family_compile_checks.py. The video families and the other options are in
test_compile_video_families.py; Flux's checks are in test_compile_flux.py (always compiled) and
test_server_families.py (the defaults, through a started server).
"""
from __future__ import annotations

import pytest

from family_compile_checks import IMAGE_FAMILIES, check_compile_model_on_family


@pytest.mark.parametrize("family", IMAGE_FAMILIES, ids=lambda f: f.name)
def test_compile_model_on_every_image_family(engine, comfy_nodes, family):
    check_compile_model_on_family(engine, comfy_nodes, family)
