"""Per family: the pack still finds, in the model ComfyUI's own loader builds, every block Compile Model should
compile and every block list DeepCache walks. A ComfyUI that renames a block list or a UNet block class fails
here, instead of leaving the model silently eager (Compile Model finds no blocks) or uncached (DeepCache passes
it through). Structure only: each generated model is loaded (UNETLoader, as the family tests do), nothing is
compiled or sampled, so a family takes the seconds of its load.

What the test expects is written here, from ComfyUI's model code (the names the doc lists), not taken from the
pack's tables: where both moved together the test would still pass, so the two are kept apart on purpose.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from tools.families import FAMILIES, load

# Per family: the diffusion model's block lists whose every child Compile Model must compile, and, for the
# transformers DeepCache serves, its (list, patches_replace key) in the order the forward runs them (None: DeepCache
# passes the family through, as its node says: Lumina 2's NextDiT loop calls no per-block replace patch).
EXPECTED = {
    "sdxl": (("input_blocks", "middle_block", "output_blocks"), "unet"),
    "sd3": (("joint_blocks",), (("joint_blocks", "double_block"),)),
    "flux": (("double_blocks", "single_blocks"), (("double_blocks", "double_block"), ("single_blocks", "single_block"))),
    "chroma": (("double_blocks", "single_blocks"),
               (("double_blocks", "double_block"), ("single_blocks", "single_block"))),
    "wan21": (("blocks",), (("blocks", "double_block"),)),
    "wan22": (("blocks",), (("blocks", "double_block"),)),
    "hunyuan_video": (("double_blocks", "single_blocks"),
                      (("double_blocks", "double_block"), ("single_blocks", "single_block"))),
    "qwen_image": (("transformer_blocks",), (("transformer_blocks", "double_block"),)),
    "lumina2": (("layers", "noise_refiner", "context_refiner"), None),
    "ltxv": (("transformer_blocks",), (("transformer_blocks", "double_block"),)),
}
UNET_BLOCKS = ("ResBlock", "SpatialTransformer")  # what a UNet's TimestepEmbedSequential blocks hold
SD15 = "accel-sd15-small.safetensors"


def test_every_family_is_listed():
    assert sorted(EXPECTED) == sorted(f.name for f in FAMILIES), "a family of tools/families.py has no expectation"


def _unet_blocks(diffusion_model, lists) -> set[str]:
    """The outermost ResBlocks and SpatialTransformers under the UNet's block lists, by path."""
    found = set()
    for name in lists:
        for path, module in getattr(diffusion_model, name).named_modules(prefix=name):
            if type(module).__name__ in UNET_BLOCKS and not any(path.startswith(p + ".") for p in found):
                found.add(path)
    return found


def _check_unet(pack, diffusion_model, lists):
    blocks, unet_paths = pack.accel.compile.blocks, pack.accel.deepcache.unet_paths
    for name in lists:
        assert hasattr(diffusion_model, name), f"{type(diffusion_model).__name__} has no {name}"
    expected = _unet_blocks(diffusion_model, lists)
    assert expected, f"no {'/'.join(UNET_BLOCKS)} in the UNet: ComfyUI renamed its block classes"
    found = {site.path for site in blocks.find_repeated_blocks(diffusion_model)}
    assert found == expected, (sorted(expected - found), sorted(found - expected))
    # DeepCache's UNet path: ComfyUI's UNetModel with a skip per input block, and everything its shallow path calls
    assert unet_paths.is_unet(diffusion_model)
    assert unet_paths.missing_names(diffusion_model) is None
    assert unet_paths.branch_count(diffusion_model) == len(diffusion_model.input_blocks)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_blocks_are_found(accel_pack, comfy_nodes, family):
    pack = accel_pack
    blocks, dit_paths = pack.accel.compile.blocks, pack.accel.deepcache.dit_paths
    model = load(comfy_nodes, family)
    diffusion_model = model.get_model_object("diffusion_model")
    name = type(diffusion_model).__name__
    lists, deepcache = EXPECTED[family.name]
    if deepcache == "unet":
        _check_unet(pack, diffusion_model, lists)
        return
    for list_name in lists:
        assert isinstance(getattr(diffusion_model, list_name, None), torch.nn.ModuleList), \
            f"{name} has no block list {list_name} (ComfyUI renamed it: the pack would leave it eager)"
    sites = {site.path: site for site in blocks.find_repeated_blocks(diffusion_model)}
    wanted = {f"{list_name}.{i}" for list_name in lists for i in range(len(getattr(diffusion_model, list_name)))}
    assert wanted <= set(sites), f"{name}: blocks Compile Model does not find: {sorted(wanted - set(sites))}"
    # Blocks whose forward takes the call's options get fresh ones (other nodes' patches seen, per-step values
    # kept out of the graphs' guards): ComfyUI renaming the parameter would pass its options into the graphs.
    for path in wanted:
        forward = inspect.signature(type(sites[path].module).forward).parameters
        if "transformer_options" in forward:
            assert sites[path].options_arg == "transformer_options", path
    if deepcache is None:
        assert not dit_paths.is_dit(diffusion_model)
        return
    assert dit_paths.block_lists(diffusion_model) == deepcache, f"{name}: DeepCache walks other block lists"
    assert dit_paths.missing_lists(diffusion_model) is None
    # The model's block loop calls the per-block replace patches DeepCache installs: patches_replace["dit"], keyed
    # by the patch name of each list (ComfyUI's forward_orig of the family, or of a class it derives from).
    source = "".join(inspect.getsource(cls) for cls in type(diffusion_model).__mro__
                     if cls.__module__.startswith("comfy."))
    assert '"dit"' in source or "'dit'" in source, f"{name}'s loop no longer looks up patches_replace['dit']"
    for _, patch in deepcache:
        assert f'"{patch}"' in source or f"'{patch}'" in source, f"{name}'s loop calls no {patch} patch"
    assert '"original_block"' in source, f"{name}'s loop no longer hands the patch its original block"


def test_sd15_unet_blocks_are_found(accel_pack, comfy_nodes):
    (model,) = comfy_nodes.UNETLoader().load_unet(SD15, "default")
    _check_unet(accel_pack, model.get_model_object("diffusion_model"), ("input_blocks", "middle_block",
                                                                       "output_blocks"))


def test_wan_vace_keeps_its_hints_in_vace_blocks(comfy_dir):
    """DeepCache refuses Wan VACE by its `vace_blocks` (its loop adds hints between blocks, which a reused span's
    residual already holds): a rename would cache it and add the hints twice. No generated VACE model exists:
    ComfyUI's class is read."""
    from comfy.ldm.wan import model as wan

    assert "self.vace_blocks" in inspect.getsource(wan.VaceWanModel.__init__)
    assert "vace_blocks" in inspect.getsource(wan.VaceWanModel.forward_orig)
