"""Every generated model family loads through ComfyUI's UNETLoader as its own model class, and samples
deterministically to a finite, non-constant latent (no compile: ComfyUI's eager code paths only)."""
from __future__ import annotations

import pytest
import torch

from families import FAMILIES, load, sample
from tools.family_models import BY_NAME


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def family(request):
    return request.param


def test_family_detected_and_samples_deterministically(comfy_nodes, family):
    model = load(comfy_nodes, family)
    assert type(model.model).__name__ == family.model_class
    assert type(model.model.model_config).__name__ == BY_NAME[family.name].detected
    latent_format = model.model.latent_format
    assert family.latent_shape[1] == latent_format.latent_channels
    assert len(family.latent_shape) == latent_format.latent_dimensions + 2

    out = sample(model, family, steps=2, seed=3)
    assert out.shape == family.latent_shape
    assert torch.isfinite(out).all()
    assert out.std() > 1e-3, "the model's output is constant"
    assert torch.equal(sample(model, family, steps=2, seed=3), out), "same seed, different latent"
