"""`make bench-gpu` (bench/gpu.py) where there is no GPU: it says so, exits 0 and writes no report; `--dry-run`
prints every step with its commands. Nothing here needs a GPU: CUDA_VISIBLE_DEVICES="" hides any the machine has,
so the real run (10 minutes on a GPU) never starts from the tests."""
from __future__ import annotations

import os
import subprocess
import sys

from tools.comfy_env import ROOT
from tools.families import FAMILIES

SCRIPT = ROOT / "bench" / "gpu.py"
DOC = ROOT / "docs" / "benchmarks" / "gpu.md"
NO_GPU_LINE = ("no CUDA GPU on this machine: nothing to run (bench/gpu.py checks only what a GPU can show; run it on "
               "a GPU machine)")
STEPS = ("models", "doctor", "dynamic-vram", "lowvram", "families", "flux", "cache", "tax")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def doc_state() -> tuple[int, int] | None:
    return (DOC.stat().st_size, DOC.stat().st_mtime_ns) if DOC.exists() else None


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    before = doc_state()
    out = tmp_path / "gpu.md"
    for args in ((), ("--out", str(out))):
        proc = run_script(*args)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == NO_GPU_LINE
        listed = "\n".join(lines[1:])
        for number, name in enumerate(STEPS, 1):  # the checks it would run, by number and name
            assert f"{number}. {name}: " in listed, listed
        assert "$ " not in proc.stdout, "without --dry-run the commands are not listed"
    assert not out.exists()
    assert doc_state() == before, "docs/benchmarks/gpu.md was written on a machine without a GPU"


def test_dry_run_lists_every_step_with_its_command():
    before = doc_state()
    proc = run_script("--dry-run")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert NO_GPU_LINE not in text and "nothing runs" in text.splitlines()[0]
    blocks = {}  # step name -> its lines (the commands or the note under it)
    for line in text.splitlines()[2:]:
        if not line.startswith("   "):
            name = line.split(". ", 1)[1].split(":", 1)[0]
            blocks[name] = [line]
        else:
            blocks[name].append(line.strip())
    assert list(blocks) == list(STEPS), text
    expected = {
        "models": "$ python tools/make_models.py --set full --only accel-tiny-flux-bench.safetensors",
        "doctor": "$ python -m accel doctor --json",
        "flux": "$ python bench/compile_model.py --family flux --latent 128 --steps 8 --variants "
                "eager,core,accel,accel-compiled",
    }
    for name, command in expected.items():
        assert blocks[name][1:] == [command], blocks[name]
    for name, block in blocks.items():
        assert "budget" in block[0] or block[1].startswith("note: "), block  # a time budget, or why nothing runs
    assert blocks["lowvram"][1].startswith("note: not measured by this script yet")

    families = blocks["families"][1:]
    assert all(c.startswith("$ python bench/compile_families.py --families ") and c.endswith(" --scale 4 --steps 4")
               for c in families), families
    listed = [name for c in families for name in c.split("--families ")[1].split(" ")[0].split(",")]
    assert sorted(listed) == sorted(family.name for family in FAMILIES)  # every family, once

    cache = blocks["cache"][1:]
    shared = "TORCHINDUCTOR_CACHE_DIR=$SCRATCH/torch ACCEL_CACHE_DIR=$SCRATCH/accel "
    # the same caches twice: the second process loads what the first compiled
    assert cache == [f"$ {shared}python bench/compile_model.py --child accel --family flux --latent 128 --steps 8 "
                     "--outputs $SCRATCH"] * 2, cache

    from tools.comfy_env import comfyui_version

    if tuple(int(p) for p in comfyui_version().split(".")[:2]) < (0, 33):
        assert blocks["dynamic-vram"][1].startswith("note: not measured"), blocks["dynamic-vram"]
    else:
        assert blocks["dynamic-vram"][1].startswith("$ python -c "), blocks["dynamic-vram"]
    assert doc_state() == before


def test_tax_probe_rehearses_on_the_cpu():
    """bench/process_tax.py --malloc-diag, the probe the GPU run needs, on the CPU in seconds (the small SD1.5
    model, Compile Model passing through by ACCEL_DISABLE_COMPILE=1): every part of its report is there, and the
    pack's tune, applied last in the same process, is read back from glibc where glibc serves malloc."""
    from tools.harness.child import read_result

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "ACCEL_MALLOC_TUNE"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "process_tax.py"), "--malloc-diag", "--shape", "sd15",
                           "--model", "accel-sd15-small.safetensors", "--latent", "8", "--steps", "2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**env, "ACCEL_DISABLE_COMPILE": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = read_result(proc.stdout)
    assert list(result["points"]) == ["torch_started", "model_loaded", "before_compile", "child_done",
                                      "graphs_loaded", "end"]
    for when in ("before", "after", "tuned"):
        assert set(result[f"cats_{when}"]) == {"main", "prompt", "new_thread"}, result[f"cats_{when}"]
        assert len(result[f"eager_{when}"]["faults"]) == len(result[f"eager_{when}"]["ms"]) == 2
    assert result["fault_price_us_before"] > 0 and isinstance(result["importers"], dict)
    if result["glibc"] and result["allocator"]["malloc_is_glibcs"]:
        assert result["tune"]["applied"] and result["points"]["end"]["params"]["mmap_threshold"] == 32 << 20
        assert result["cats_tuned"]["prompt"]["chunks"].get("mmapped", 0) == 0, result["cats_tuned"]
