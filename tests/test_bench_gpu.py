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
STEPS = ("models", "doctor", "lowvram", "flux", "tax", "comfyui-0.33", "families", "cache")


def run_script(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env_vars}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def load_gpu_script():
    """bench/gpu.py as a module, to render a step's report from a real run's RESULT."""
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(gpu)
    return gpu


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
                "eager,core,accel,accel-compiled,accel-graphs",
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

    assert blocks["comfyui-0.33"][1].startswith("note: not measured: no ComfyUI 0.33 here") or \
        blocks["comfyui-0.33"][1].startswith("$ "), blocks["comfyui-0.33"]
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
    # the tax step's report renders it: the environment, the six points, before / after / tuned
    run = {"cmd": proc.args, "stdout": proc.stdout, "rc": 0, "timed_out": False, "seconds": 1.0}
    lines = load_gpu_script().tax_step([run])
    diag = lines[lines.index("**glibc malloc** (`bench/process_tax.py --malloc-diag`, the benchmark Flux's shape):"):]
    assert sum(line.startswith("- glibc's settings at ") for line in diag) == 6, diag
    assert [line.split(":")[0] for line in diag if line.startswith(("- before", "- after", "- tuned"))] == [
        "- before", "- after", "- tuned"], diag


def dry_run_blocks(text: str) -> dict[str, list[str]]:
    blocks = {}
    for line in text.splitlines()[2:]:
        if not line.startswith("   "):
            blocks[line.split(". ", 1)[1].split(":", 1)[0]] = []
        else:
            blocks[list(blocks)[-1]].append(line.strip())
    return blocks


def test_the_033_step_runs_on_the_bundled_comfyui(tmp_path):
    """tools/gpu_bundle.sh's unpacked 0.33 (its two variables): the step links the benchmark Flux there, then
    measures each VRAM mode in a process on caches of its own, with that ComfyUI and its wheels."""
    proc = run_script("--dry-run", "--only", "comfyui-0.33,flux", ACCEL_GPU_COMFYUI_033=str(tmp_path / "ComfyUI"),
                      ACCEL_GPU_SITE_033=str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stderr
    blocks = dry_run_blocks(proc.stdout)
    assert list(blocks) == ["flux", "comfyui-0.33"], "--only keeps the plan's order"
    env = f"COMFYUI_DIR={tmp_path / 'ComfyUI'} ACCEL_COMFYUI=0.33.0 "
    caches = "TORCHINDUCTOR_CACHE_DIR=$SCRATCH/N/torch ACCEL_CACHE_DIR=$SCRATCH/N/accel "
    commands = blocks["comfyui-0.33"]
    assert commands[0].startswith(f"$ {env}{caches}python -c ") and commands[0].endswith(
        "/models/diffusion_models/accel-tiny-flux-bench.safetensors"), commands[0]
    assert commands[1:] == [f"$ {env}{caches}python bench/dynamic_vram.py --vram {vram} --latent 128 --steps 8 "
                            "--rounds 3" for vram in ("dynamic", "disabled")]
    wrong = run_script("--dry-run", "--only", "flux,nothing")
    assert wrong.returncode == 2 and "--only: no step nothing; the steps: models, doctor" in wrong.stderr


PARSE_ONLY = """import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, *args, **kwargs):
    parsed = parse(self, *args, **kwargs)
    print('PARSED', sorted(vars(parsed)))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python SCRIPT` puts it first
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_every_command_of_the_plan_parses_its_arguments(tmp_path):
    """Each bench script the plan starts, with the plan's own arguments: it imports and its parser takes them
    (it stops right after parsing), so no argument slip waits for a GPU to be found."""
    proc = run_script("--dry-run", ACCEL_GPU_COMFYUI_033=str(tmp_path / "ComfyUI"))
    commands = [c[2:] for block in dry_run_blocks(proc.stdout).values() for c in block if c.startswith("$ ")]
    scripts = [c.split("python ", 1)[1].split() for c in commands if " -c " not in c and " -m " not in c]
    assert {s[0] for s in scripts} >= {"bench/compile_model.py", "bench/compile_families.py", "bench/process_tax.py",
                                       "bench/dynamic_vram.py", "tools/make_models.py"}, scripts
    for argv in {tuple(a.replace("$SCRATCH", str(tmp_path)) for a in s) for s in scripts}:
        done = subprocess.run([sys.executable, "-c", PARSE_ONLY, *argv], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
        assert done.returncode == 0 and "PARSED" in done.stdout, (argv, done.stderr[-2000:])


def test_the_033_report_renders_from_a_real_run():
    """bench/dynamic_vram.py on this CPU (the generated SD3, 4 MB, two steps, eager alone: seconds; the generated
    Flux is 2 GB), its RESULT read by the step's report as on a GPU: the table's row, and the mode said (no dynamic
    VRAM without a GPU)."""
    gpu = load_gpu_script()
    cmd = [sys.executable, "bench/dynamic_vram.py", "--vram", "dynamic", "--family", "sd3", "--model",
           "accel-tiny-sd3.safetensors", "--latent", "8", "--steps", "2", "--rounds", "1", "--variants", "eager"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    run = {"cmd": cmd, "stdout": done.stdout, "stderr": done.stderr, "rc": 0, "timed_out": False, "seconds": 1.0}
    lines = gpu.comfyui_033_step([{"cmd": ["python", "-c"], "stdout": "", "rc": 0, "timed_out": False}, run])
    assert lines[0].startswith("| --vram | variant | model dynamic | first sampling |"), lines
    row = lines[2].split(" | ")
    assert row[0] == "| dynamic" and row[1] == "eager" and row[5].replace(".", "").isdigit(), lines[2]
    assert any("without dynamic VRAM (no CUDA GPU)" in line for line in lines), lines
    assert not [c for c in gpu.checks if c[0] == "FAIL"], gpu.checks
