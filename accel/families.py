"""What the engine knows of each model family, in one place: which modules are the blocks Compile Model compiles,
which block lists DeepCache walks on a transformer and what it keeps of their streams, and which block inputs stay
at a batch of 1 whatever the batch. Keyed by ComfyUI's class names (matched on a class and its bases: Flux Kontext
is a Flux, Wan's variants are WanModels), so a family ComfyUI adds under a known class is met without an entry.

Adding a family (docs/contributing.md, "Adding a model family"): its generated test model (tools/family_models.py,
tools/families.py), then an entry here where its blocks are not a ModuleList of one class (UNET_BLOCK_CLASSES), for
DeepCache (DIT_BLOCK_LISTS), or where a block input is built once and broadcast (UNBATCHED_INPUTS). The family tests
(tests/test_family_structure.py) fail when an entry names an attribute this ComfyUI renamed.

Importing this module needs neither torch nor ComfyUI."""
from __future__ import annotations

# Compile Model (compile/blocks.py): UNet blocks are nested in TimestepEmbedSequential containers, so they are found
# by class name; DiT blocks are found as the children of an nn.ModuleList that all share one class (no entry).
UNET_BLOCK_CLASSES = ("ResBlock", "SpatialTransformer", "VideoResBlock", "SpatialVideoTransformer")

# DeepCache on a transformer (deepcache/dit_paths.py): each class's block lists, in the order its forward runs
# them, and the replace key its loop looks up. A model whose loop does not call these patches simply never reuses
# anything (every call runs in full, as the stats then say).
DIT_BLOCK_LISTS = {
    "Flux": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "Chroma": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "HunyuanVideo": (("double_blocks", "double_block"), ("single_blocks", "single_block")),
    "WanModel": (("blocks", "double_block"),),
    "QwenImageTransformer2DModel": (("transformer_blocks", "double_block"),),
    "MMDiT": (("joint_blocks", "double_block"),),
    "LTXVModel": (("transformer_blocks", "double_block"),),
}
# DeepCache's auto schedule (deepcache/presets.py): the transformers that make video (their preset reuses more).
VIDEO_DIT_CLASSES = ("WanModel", "HunyuanVideo", "LTXVModel")
# The streams of a block patch's arguments whose change over a span DeepCache keeps (the image tokens, and the text
# tokens where the loop carries them); the first is the signal its adaptive schedule reads.
DIT_STREAMS = ("img", "txt")

# Compile Model's batch twin (compile/child/batch_twin.py): per block class (or a base of it), the inputs by their
# name in its forward that stay at a batch of 1 at every batch: tables the model builds once and broadcasts over
# the batch. Repeating them makes a twin that no call of the model ever fits. Looked for with a forward pre-hook at
# a batch of 1 and 2 on every generated family (video.md, "Compile Model as frames, sizes and batch change"): only
# Wan's rope table, which rope_encode makes at a batch of 1 (WanAttentionBlock and its variants: VACE, audio,
# animate, causal). The video test checks Wan's at cfg 1.
UNBATCHED_INPUTS = {"WanAttentionBlock": frozenset({"freqs"})}
