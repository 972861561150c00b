"""A test-only ComfyUI node: a generated model family's conditioning and empty latent (tools/families.py), so a
started server can sample transformer models without their multi-GB text encoders. Linked into a server's
custom_nodes by the tests and benchmarks that need it; never part of the pack."""
from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]  # the project, for `tools`
if str(_ROOT) not in sys.path:
    sys.path.append(str(_ROOT))


class AccelTestInputs:
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("positive", "negative", "latent")
    FUNCTION = "make"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        from tools.families import BY_FAMILY

        return {"required": {"family": (sorted(BY_FAMILY),), "seed": ("INT", {"default": 0, "min": 0}),
                             "tokens": ("INT", {"default": 77, "min": 1, "max": 4096})}}

    def make(self, family, seed, tokens):
        import torch
        from tools.families import BY_FAMILY

        case = BY_FAMILY[family]
        positive, negative = case.conds(seed, tokens)
        return positive, negative, {"samples": torch.zeros(case.latent_shape)}


NODE_CLASS_MAPPINGS = {"AccelTestInputs": AccelTestInputs}
