"""A long mixed run on one server equals each prompt run alone in a fresh server (#16, at a size that fits CI;
bench/soak.py runs the full 30 prompts). One server runs fifteen prompts that mix what users change between
prompts: sizes, batch sizes, cfg 1 and cfg > 1, DeepCache on and off at two intervals, LoRA strengths, Swap Weights
to another checkpoint and back, Compile Model on and off, KSampler and KSamplerAdvanced, the SD1.5 UNet and the
SD3 transformer (conditioning from a test-only node). Each configuration runs three times. Every output equals the
same prompt run alone and eagerly in a fresh server (ACCEL_DISABLE_COMPILE=1: the Compile Model node passes the
model through, so no background child spends CI's cores on a compile nobody loads): bit for bit without Compile
Model, within the compiled tolerance with it (once the background compile is done, its prompts run compiled
blocks). The mixed server uses the test run's compile cache, so it finds what earlier tests compiled for the same
models and sends only the rest to its child. The later passes compile nothing cold (they may load what the
background child compiled), and the last one leaves the server's memory where the one before it did (read with
glibc's mmap threshold fixed, so that RSS follows what the server holds, not the allocator's high-water marks).
"""
from __future__ import annotations

import pytest
import torch

from compile_helpers import assert_close_to_eager
from tools.soak_prompts import CONFIGS, EAGER, PASSES, cold_compiles, rss_mb, run_latent, server_of

pytestmark = [pytest.mark.server, pytest.mark.full(why=(
    "a long mixed run of the pack's features in one server; make test runs each feature's prompts in its own "
    "tests (test_server_e2e.py, test_server_families.py, test_templates.py)"))]
# RSS that follows what the server holds. By default glibc raises its mmap threshold to the size of each large
# block freed, so later blocks of that size come from heaps it keeps: passes of the same prompts, nothing
# compiled or loaded, then ended at 1395, 1551, 1461, 1406 and 1510 MB (2026-11-26, on a cache with the kinds
# precompiled), swings over the 5% a leak must stay under, and the bound failed on that noise twice. With the
# threshold fixed, a freed large block goes back to the system at once: the same passes ended at 1332, 1343, 1344,
# 1344 and 1344 MB. Only the allocator's bookkeeping changes, not what the server computes.
EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def fresh_references(tmp_path) -> dict:
    """Each configuration alone and eager, in a fresh server of its own."""
    references = {}
    for i, prompt in enumerate(CONFIGS):
        with server_of(tmp_path / f"fresh-{i}", EAGER) as fresh:
            references[prompt] = run_latent(fresh, prompt, f"fresh-{i}")
    return references


def test_a_long_mixed_run_equals_each_prompt_alone_in_a_fresh_server(tmp_path, private_compile_cache):
    outputs, rss_after_pass, jobs_after_pass = [], [], []
    # The mixed server on the test run's compile cache: what the soak checks is state over a long run, not a cold
    # compile (test_compile_model.py, test_faults.py and the server tests check those), so kinds an earlier test
    # compiled load from the cache and only the rest go to a child (run alone: all of them).
    with server_of(tmp_path / "mixed", {"ACCEL_CACHE_DIR": str(private_compile_cache), **EXACT_RSS}) as mixed:
        for p, indices in enumerate(PASSES):
            for index in indices:
                prompt, n = CONFIGS[index], len(outputs)
                outputs.append((n, prompt, run_latent(mixed, prompt, f"mixed-{n}")))
            if p == 0:
                # made while the first pass's background child compiles (the mixed server idle, no prompt of it
                # timed meanwhile): the test waits on that child anyway, and the references' servers are apart
                references = fresh_references(tmp_path)
            # the pass's background work done and its graphs loaded before memory is read: a child that ends
            # during the next pass would otherwise load there and count as growth (failed once so, 1382 -> 1492 MB)
            jobs_after_pass.append(len(mixed.wait_for_background()["finished"]))
            rss_after_pass.append(rss_mb(mixed))
            if p == 0:  # every configuration seen: its compiles done
                before = cold_compiles(mixed)
        after = cold_compiles(mixed)
        log = mixed.log_tail()

    for n, prompt, out in outputs:
        what = f"prompt {n + 1} ({prompt.name}) against the same prompt alone in a fresh server"
        if prompt.compiled:
            assert_close_to_eager(out, references[prompt], what)
        else:
            assert torch.equal(out, references[prompt]), what
    new = {kind: after[kind] - before.get(kind, 0) for kind in after if after[kind] != before.get(kind, 0)}
    assert not new, f"the second pass compiled cold for configurations already seen: {new}\n{log}"
    # the last two passes end in the same state (the same prompt last, every graph loaded): memory stays put
    assert rss_after_pass[2] <= 1.05 * rss_after_pass[1], \
        f"the server grew: RSS after each pass {rss_after_pass} MB, background jobs done by then {jobs_after_pass}"
