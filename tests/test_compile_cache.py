"""The persistent compile cache across processes: two processes compiling the same kind at once leave a cache a
third loads whole; a damaged entry (one of the pack's artifacts, torch's FX graphs) is skipped and rebuilt, damaged
torch files are set aside and rebuilt from the artifacts; precompile warms a later server's workflow, export/import
moves the cache, the size cap evicts least recently used, and an unwritable directory or a failing first run never
costs the prompt. A block carrying ComfyUI 0.33's load-time dtype records precompiles and loads; one whose records
have a name the pack does not know is a warning in the log, not a silent fallback.

The cross-process tests share one cache directory (module scope) and run in order: two cold processes at once and a
warm third, damaged entries, damaged torch files, then precompile at a new size and a server workflow at that size,
then export/import. Each stands alone too (`pytest path::name`): the `filled` fixture compiles the kind into the
shared cache with one process when no earlier test of the run has. Their probes (tests/cache_probe.py via
probe_runs.py) sample LTX-Video, one block kind, to keep CI's time; the UNet's kinds cross processes in the
precompile test. Hit and miss counts are torch's own counters
(counters["inductor"]["fxgraph_cache_hit"/"miss"], counters["aot_autograd"]["autograd_cache_hit"/"miss"]).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tools import families
from compile_helpers import SMALL, assert_close_to_eager, assert_every_artifact_whole, load, sample
from probe_runs import result_of, run_probe, start_probe
from tools.comfy_env import ROOT, comfyui_dir
from tools.comfy_server import ComfyServer, load_workflow

PRECOMPILED = (192, 192)  # a size the probes never sample, so only precompile can have compiled its graphs


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One cache directory shared by the processes of this module, and what each process reported."""
    return {"dir": tmp_path_factory.mktemp("accel-cache"), "runs": {}}


@pytest.fixture
def filled(shared, tmp_path_factory):
    """The shared cache with the probe's kind compiled into it and the reference outputs (`cold`, `eager`,
    `output`): what the first test leaves; a test run without it gets them from one cold process here."""
    if "output" not in shared["runs"]:
        out = tmp_path_factory.mktemp("filled")
        cold, _ = run_probe(shared["dir"], out / "cold.pt", eager=out / "eager.pt")
        shared["runs"].update(cold=cold, eager=torch.load(out / "eager.pt"), output=torch.load(out / "cold.pt"))
    return shared


def environment_dir(cache_dir: Path) -> Path:
    (env_dir,) = [p for p in cache_dir.iterdir() if (p / "fingerprint.json").is_file()]
    return env_dir


@pytest.mark.full(why=(
    "processes compiling into one cache at once; make test shares the run's cache between its two test "
    "processes and checks a cache's reuse in test_export_and_import_move_the_cache"))
def test_two_processes_compiling_at_once_leave_a_cache_a_third_loads_whole(shared, tmp_path, accel_pack):
    """Two processes (a fleet's workers on a shared volume) compile the same kind into one empty cache at the same
    time: both are correct and leave a consistent cache. A third process then compiles the same graphs, every one
    from their caches (torch's hit counters, no miss), faster, to the same bits."""
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    first = start_probe(shared["dir"], tmp_path / "a.pt", eager=tmp_path / "eager.pt", meet=tmp_path / "meet")
    second = start_probe(shared["dir"], tmp_path / "b.pt", meet=tmp_path / "meet")
    (a, _), (b, _) = result_of(first), result_of(second)
    eager, output = torch.load(tmp_path / "eager.pt"), torch.load(tmp_path / "a.pt")
    shared["runs"].update(cold=a, eager=eager, output=output)
    for name, run in (("a", a), ("b", b)):
        assert run["compiles"] > 0 and set(run["paths"].values()) == {"compiled"}, run
        assert_close_to_eager(torch.load(tmp_path / f"{name}.pt"), eager, f"process {name} beside the other")
    # both compiled cold: they did run at once (neither found the other's graphs)
    assert a["disk_cache"].get("fx_graph_misses", 0) > 0 and b["disk_cache"].get("fx_graph_misses", 0) > 0, (a, b)
    # one of them saved each artifact (the other may find it there first, and keeps it)
    saved = sum(run["compile_cache"]["environments"][0]["artifacts_saved"] for run in (a, b))
    assert saved > 0, (a["compile_cache"], b["compile_cache"])
    assert_every_artifact_whole(store, shared["dir"])
    assert not list(shared["dir"].rglob(".tmp-*")), "a temporary file of an interrupted write was left"

    warm, _ = run_probe(shared["dir"], tmp_path / "warm.pt")
    shared["runs"]["warm"] = warm
    assert warm["compiles"] == a["compiles"] > 0
    assert warm["disk_cache"].get("fx_graph_hits", 0) == warm["compiles"], warm["disk_cache"]
    assert warm["disk_cache"].get("aot_autograd_hits", 0) == warm["compiles"], warm["disk_cache"]
    assert warm["disk_cache"].get("fx_graph_misses", 0) == 0, warm["disk_cache"]
    assert warm["compile_cache"]["environments"][0]["artifacts_skipped_corrupt"] == 0, warm["compile_cache"]
    assert warm["compile_seconds"] < a["compile_seconds"], (warm["compile_seconds"], a["compile_seconds"])
    torch.testing.assert_close(torch.load(tmp_path / "warm.pt"), output, rtol=0, atol=0)
    # the cache lives where it was told to, and torch's own settings are as they were outside the pack's calls
    assert environment_dir(shared["dir"]).joinpath("inductor", "fxgraph").is_dir()
    for run in (a, b, warm):
        assert run["torch_state_changes"] == [], run["torch_state_changes"]


def test_damaged_entries_are_skipped_and_rebuilt(filled, tmp_path, accel_pack):
    shared = filled
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    env_dir = environment_dir(shared["dir"])
    artifact = sorted(env_dir.glob("artifacts/*/*.bin"))[0]
    artifacts_of_its_kind = len(list(artifact.parent.glob("*.bin")))
    artifact.write_bytes(artifact.read_bytes()[:1000])  # truncated, as by a full disk or a killed copy
    graphs = sorted(p for p in (env_dir / "inductor" / "fxgraph").rglob("*") if p.is_file())
    for graph in graphs:  # torch's own entries too
        graph.write_bytes(graph.read_bytes()[:20])
    run, stderr = run_probe(shared["dir"], tmp_path / "damaged.pt")
    assert "[Accel] compile cache: skipping" in stderr and str(artifact) in stderr
    assert run["compile_cache"]["environments"][0]["artifacts_skipped_corrupt"] == 1
    # the damaged artifact was deleted and the recompile saved a whole one in its place (unpack checks each)
    rebuilt = list(artifact.parent.glob("*.bin"))
    assert len(rebuilt) == artifacts_of_its_kind
    for path in rebuilt:
        store.unpack_artifact(path.read_bytes())  # raises on a damaged file
    # torch's truncated FX graphs: the intact artifacts wrote theirs back, torch recompiled the rest
    assert run["disk_cache"].get("fx_graph_misses", 0) >= 1
    for key_dir in {p.parent for p in graphs}:
        assert any(p.stat().st_size > 20 for p in key_dir.iterdir()), f"no whole FX graph left in {key_dir}"
    assert_close_to_eager(torch.load(tmp_path / "damaged.pt"), shared["runs"]["output"], "after a damaged entry")


@pytest.mark.full(why=(
    "damaged torch cache files; make test meets damaged entries in "
    "test_damaged_entries_are_skipped_and_rebuilt"))
def test_damaged_torch_files_are_set_aside_and_rebuilt_from_the_artifacts(filled, tmp_path):
    """torch's own files in the cache damaged (every file under `inductor/` cut short: the generated code and
    kernels torch loads without a check): the process compiles outside the cache, stays compiled and correct, and
    sets the damaged folder aside with one warning; the next process rebuilds it from the pack's checksummed
    artifacts and compiles nothing cold."""
    shared = filled
    torch_files = [p for p in shared["dir"].glob("*/inductor/**/*") if p.is_file() and p.stat().st_size > 20]
    assert torch_files, "torch wrote nothing into the cache"
    for path in torch_files:  # cut short, as by a crash or a disk error under torch's own writes
        path.write_bytes(path.read_bytes()[:20])

    damaged, stderr = run_probe(shared["dir"], tmp_path / "damaged.pt")
    assert damaged["compiles"] > 0 and set(damaged["paths"].values()) == {"compiled"}, damaged
    assert_close_to_eager(torch.load(tmp_path / "damaged.pt"), shared["runs"]["eager"],
                          "compiled over damaged torch files")
    (environment,) = damaged["compile_cache"]["environments"]
    assert environment["torch_files_set_aside"] == 1 and environment["writable"] is True, environment
    warnings = [line for line in stderr.splitlines() if "[Accel] compile cache:" in line]
    assert len(warnings) == 1 and "were damaged" in warnings[0] and "cache clear" in warnings[0], warnings
    assert "runs eagerly" not in stderr, stderr[-3000:]

    rebuilt, stderr = run_probe(shared["dir"], tmp_path / "rebuilt.pt")
    assert rebuilt["disk_cache"].get("fx_graph_misses", 0) == 0, rebuilt["disk_cache"]
    assert rebuilt["disk_cache"].get("fx_graph_hits", 0) == rebuilt["compiles"] > 0, rebuilt["disk_cache"]
    assert "[Accel] compile cache:" not in stderr, stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "rebuilt.pt"), shared["runs"]["output"], rtol=0, atol=0)


@pytest.mark.full(why=(
    "a server served by `accel precompile`'s graphs; make test records and loads precompiled functions in "
    "test_a_block_with_comfyui_033s_dtype_records_precompiles_and_loads and runs precompile's refusals in "
    "test_precompile_refuses_a_cache_it_could_keep_nothing_in"))
def test_precompile_then_a_server_workflow_compiles_nothing_cold(shared, tmp_path, monkeypatch, accel_pack):
    """`python -m accel precompile` at a size no process sampled, with the server's flags, then a new ComfyUI
    server runs a workflow at that size: precompile saved each kind whole (precompiled.py), so the server starts
    no child and never runs Dynamo; its compiled prompt (on the CPU once inductor's checks ran in their thread,
    after the first prompt) is served by those precompiled functions. The server runs with flags that change
    what ComfyUI computes (--force-fp32, and --fast's features, no-ops on the CPU but part of a saved graph's
    context), which precompile is given by --comfyui-args: without them, no saved graph would serve the server.
    (Before a fix, precompile kept --fast as parsed, an empty list where the server holds every feature, and the
    server sent the kinds to a child.)"""
    width, height = PRECOMPILED
    env = {**os.environ, "ACCEL_CACHE_DIR": str(shared["dir"]), "COMFYUI_DIR": str(comfyui_dir())}
    proc = subprocess.run([sys.executable, "-m", "accel", "precompile", "--model", SMALL,
                           "--sizes", f"{width}x{height}", "--batch", "1", "--comfyui-args=--force-fp32 --fast"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["compiles"] > 0 and report["disk_cache"].get("fx_graph_misses", 0) > 0, report
    saved = report["precompiled"]
    assert len(saved) == report["kinds"] and all(isinstance(n, int) and n > 0 for n in saved.values()), saved

    graph = load_workflow("accel_txt2img_api.json")
    del graph["3"], graph["10"]  # DeepCache and Compile VAE out: only the UNet's graphs count here
    graph["8"]["inputs"]["model"] = ["2", 0]
    graph["11"]["inputs"]["vae"] = ["9", 0]
    graph["7"]["inputs"].update(width=width, height=height)
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(shared["dir"]))
    with ComfyServer(tmp_path / "server", extra_args=("--force-fp32", "--fast"), api_nodes=False) as server:
        server.run_workflow(graph)
        server.wait_for_background(timeout=300)  # the CPU checks and the loading of the child's graphs
        graph["8"]["inputs"]["seed"] += 1  # another prompt (the same one would run nothing)
        server.run_workflow(graph)
        stats = server.get_json("/accel/stats")["compile"]
    after = stats["background"]
    assert not (after["finished"] or after["running"] or after["queued"] or after["held_until_idle"]), (
        f"the server started a child: {after}")
    assert stats["totals"]["compiles"] == 0, f"the server ran Dynamo: {stats['totals']}"
    served = [k for k in stats["kinds"] if k["precompiled"]["calls"]]
    assert served, [(k["kind"], k["precompiled"], k["eager_calls"]) for k in stats["kinds"]]


def test_precompile_refuses_a_cache_it_could_keep_nothing_in(tmp_path):
    """ACCEL_CACHE_DIR below a file (as below a folder it may not write, or one others may write): precompile
    names the folder and ACCEL_CACHE_DIR and exits 2, before it loads the model. Before, it compiled every size
    for minutes, kept nothing and exited 0 (found by a review): an image build warmed nothing, unseen."""
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "ACCEL_CACHE_DIR": str(tmp_path / "a-file" / "cache"), "COMFYUI_DIR": str(comfyui_dir())}
    proc = subprocess.run([sys.executable, "-m", "accel", "precompile", "--model", SMALL, "--sizes", "64x64"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"the compile cache at {tmp_path / 'a-file' / 'cache'}" in proc.stderr and "ACCEL_CACHE_DIR" in \
        proc.stderr and "model_type" not in proc.stderr, proc.stderr[-3000:]  # ComfyUI says it when it loads one


def test_precompile_names_a_server_flag_comfyui_does_not_take(tmp_path):
    """--comfyui-args goes through ComfyUI's own parser: a flag it lacks, or a value it refuses, is an error that
    names it, before anything is loaded or written."""
    env = {**os.environ, "ACCEL_CACHE_DIR": str(tmp_path / "cache"), "COMFYUI_DIR": str(comfyui_dir())}
    for flags, expected in (("--fast --no-such-flag", "has no flag --no-such-flag"),
                            ("--reserve-vram lots", "ComfyUI refused the flags '--reserve-vram lots'")):
        proc = subprocess.run([sys.executable, "-m", "accel", "precompile", "--model", SMALL,
                               f"--comfyui-args={flags}"], cwd=ROOT, capture_output=True, text=True, env=env,
                              check=False)
        assert proc.returncode == 2 and "error: --comfyui-args: " in proc.stderr and expected in proc.stderr, (
            proc.stderr[-2000:])
    assert not (tmp_path / "cache").exists()


def test_precompile_and_export_refuse_what_they_cannot_do_with_an_error(accel_pack, comfy_dir, tmp_path, monkeypatch,
                                                                         capsys):
    """Each an error that says what to do (exit 2), where before: a LoRA given as --model ended in ComfyUI's
    traceback; with compiling off (ACCEL_DISABLE_COMPILE, or no C++ compiler or Triton) precompile sampled eagerly
    and exited 0 having saved nothing, so an image build warmed nothing unseen; an export to a folder ended in a
    traceback and left its .partial file behind."""
    import folder_paths

    cli = importlib.import_module(accel_pack.__name__ + ".accel.__main__")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path / "cache"))
    lora = folder_paths.get_full_path("loras", "accel-sd15-lora.safetensors")

    def refused(*argv: str) -> str:
        capsys.readouterr()
        assert cli.main(["--comfyui", str(comfy_dir), *argv]) == 2  # as run from the pack's folder in ComfyUI
        return capsys.readouterr().err

    assert "finds no diffusion model" in refused("precompile", "--model", lora, "--cpu")
    monkeypatch.setenv("ACCEL_DISABLE_COMPILE", "1")
    assert "nothing to precompile" in refused("precompile", "--model", SMALL, "--cpu")
    monkeypatch.delenv("ACCEL_DISABLE_COMPILE")
    assert "--cuda-device picks the GPU" in refused("precompile", "--model", SMALL, "--cpu",
                                                    "--comfyui-args=--cuda-device 1")
    store = importlib.import_module(accel_pack.__name__ + ".accel.cache.store")
    assert store.EnvironmentCache(tmp_path / "cache", "cpu").check_usable()  # something to export
    (tmp_path / "exports").mkdir()
    assert "is a folder" in refused("cache", "export", str(tmp_path / "exports"))
    assert list((tmp_path / "exports").iterdir()) == [] and not list(tmp_path.glob("*.partial"))


def test_precompile_finds_models_in_the_servers_extra_model_paths(accel_pack, comfy_dir, tmp_path, monkeypatch):
    """A server started with --extra-model-paths-config finds models in that file's folders; precompile given the
    same flag (--comfyui-args) now does too (before, its --model there was 'no such file')."""
    import copy

    import folder_paths

    monkeypatch.setattr(folder_paths, "folder_names_and_paths", copy.deepcopy(folder_paths.folder_names_and_paths))
    models = tmp_path / "elsewhere" / "diffusion_models"
    models.mkdir(parents=True)
    (models / "accel-extra-only.safetensors").write_bytes(b"")
    config = tmp_path / "extra.yaml"
    config.write_text(f"elsewhere:\n  diffusion_models: {models}\n")
    precompile = importlib.import_module(accel_pack.__name__ + ".accel.precompile")
    precompile.import_comfyui(Path(comfy_dir), True, f"--extra-model-paths-config {config}")
    assert folder_paths.get_full_path("diffusion_models", "accel-extra-only.safetensors") == str(
        models / "accel-extra-only.safetensors")


def test_cache_commands_find_the_cache_of_a_comfyui_base_directory(tmp_path):
    """ComfyUI started with --base-directory (ComfyUI Desktop's user folder, a server's data volume) keeps
    custom_nodes/ and the nodes' compile cache there, its code elsewhere: the commands, run from the pack's folder
    in it, use that cache (before: "no ComfyUI at ...", as they looked for main.py)."""
    base = tmp_path / "base"
    pack = base / "custom_nodes" / "comfyui-accel"
    pack.parent.mkdir(parents=True)
    pack.symlink_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_DIR", "ACCEL_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-m", "accel", "cache", "info"], cwd=pack, env={**env, "PWD": str(pack)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["root"] == str(base / "accel_cache"), proc.stdout


def test_export_and_import_move_the_cache(filled, tmp_path):
    shared = filled
    exported = tmp_path / "cache.zip"
    env = {**os.environ, "ACCEL_CACHE_DIR": str(shared["dir"])}
    # auto mode's findings travel too: its saved block shares and the kinds found to compile only in pieces (the
    # probes compile "always", so none were found: they are written here in the files' own format); on import,
    # what the target machine found itself wins
    env_id = next(p.name for p in shared["dir"].iterdir() if (p / "fingerprint.json").is_file())
    (shared["dir"] / env_id / "auto_call_shares.json").write_text(json.dumps({"kind-a": 0.2, "kind-b": 0.01}))
    in_pieces = {"kind-c": {"why": "a graph break", "code": "exported"}, "kind-d": {"why": "two", "code": "exported"}}
    (shared["dir"] / env_id / "auto_in_pieces.json").write_text(json.dumps(in_pieces))
    cli = [sys.executable, "-m", "accel", "cache"]
    out = subprocess.run([*cli, "export", str(exported)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "exported" in out.stdout, out.stderr
    target = tmp_path / "imported"
    (target / env_id).mkdir(parents=True)
    (target / env_id / "auto_call_shares.json").write_text(json.dumps({"kind-a": 0.5}))
    (target / env_id / "auto_in_pieces.json").write_text(json.dumps({"kind-c": {"why": "mine", "code": "here"}}))
    out = subprocess.run([*cli, "import", str(exported)], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "ACCEL_CACHE_DIR": str(target)})
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr + out.stdout
    source_files = {p.relative_to(shared["dir"]) for p in shared["dir"].glob("*/artifacts/*/*.bin")}
    assert {p.relative_to(target) for p in target.glob("*/artifacts/*/*.bin")} == source_files
    assert json.loads((target / env_id / "auto_call_shares.json").read_text()) == {"kind-a": 0.5, "kind-b": 0.01}
    assert json.loads((target / env_id / "auto_in_pieces.json").read_text()) == {
        "kind-c": {"why": "mine", "code": "here"}, "kind-d": in_pieces["kind-d"]}
    # a new process on the imported cache compiles nothing cold, C++ kernels included: it builds no C++ source
    # (the run's compiler cache logs every build, each with its test); without that log, it takes a fraction of
    # the cold compile's time
    calls_before = compiler_calls()
    run, _ = run_probe(target, tmp_path / "imported.pt")
    assert run["disk_cache"].get("fx_graph_misses", 0) == 0 and run["disk_cache"]["fx_graph_hits"] == run["compiles"]
    if calls_before is not None:
        assert compiler_calls() == calls_before, "the process on the imported cache built C++ kernels"
    else:
        assert run["compile_seconds"] < 0.5 * shared["runs"]["cold"]["compile_seconds"], \
            (run["compile_seconds"], shared["runs"]["cold"]["compile_seconds"])

    # built for another torch: skipped with the reason, nothing written
    other = tmp_path / "other-torch.zip"
    with zipfile.ZipFile(exported) as src, zipfile.ZipFile(other, "w") as dst:
        manifest = json.loads(src.read("manifest.json"))
        for env_entry in manifest["environments"]:
            env_entry["env_id"] = "cpu-000000000000"
            env_entry["fingerprint"]["torch"] = "1.0.0"
            env_entry["files"] = []
        dst.writestr("manifest.json", json.dumps(manifest))
    out = subprocess.run([*cli, "import", str(other)], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "ACCEL_CACHE_DIR": str(tmp_path / "other")})
    assert out.returncode == 0 and "skipped cpu-000000000000: built for torch 1.0.0" in out.stdout, out.stdout
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())

    # one file altered after export (its manifest hash no longer matches): refused by name, nothing written
    altered = tmp_path / "altered.zip"
    with zipfile.ZipFile(exported) as src, zipfile.ZipFile(altered, "w") as dst:
        victim = [n for n in src.namelist() if n != "manifest.json"][-1]
        for name in src.namelist():
            data = src.read(name)
            dst.writestr(name, data + b"#" if name == victim else data)
    out = subprocess.run([*cli, "import", str(altered)], cwd=ROOT, capture_output=True, text=True,
                         env={**env, "ACCEL_CACHE_DIR": str(tmp_path / "altered")})
    assert out.returncode == 2 and victim in out.stderr and "does not match the manifest's checksum" in out.stderr \
        and "Nothing was imported" in out.stderr, out.stderr
    assert not (tmp_path / "altered").exists() or not any((tmp_path / "altered").rglob("*.*")), "a partial import"

    # not a cache file at all: a clear error, exit code 2
    bogus = tmp_path / "bogus.zip"
    bogus.write_text("hello")
    out = subprocess.run([*cli, "import", str(bogus)], cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "is not a compile cache exported by" in out.stderr, out.stderr


def compiler_calls() -> int | None:
    """How many C++ sources this test has built so far (kernels; inductor's precompiled header, which every new
    process builds, left out), by the compiler cache's log (tools/cxx_cache.py: a line per build, naming what it
    built and the test whose process built it); None where the run has no compiler cache."""
    log = os.environ.get("ACCEL_TEST_CXX_LOG")
    if not log:
        return None
    test = os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
    try:
        return sum(1 for line in Path(log).read_text().splitlines() if line.endswith(f" source {test}"))
    except FileNotFoundError:
        return 0


def test_size_cap_evicts_least_recently_used(accel_pack, tmp_path, monkeypatch):
    store = sys.modules[accel_pack.__name__ + ".accel.cache.store"]
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(tmp_path))
    env = store.EnvironmentCache(tmp_path, "cpu")
    assert env.check_usable()

    def fill(path: Path, megabytes: int, age_s: float) -> Path:
        path.mkdir(parents=True)
        (path / "blob").write_bytes(b"\0" * (megabytes << 20))
        (path / "last_used").touch()
        os.utime(path / "last_used", (1e9 - age_s, 1e9 - age_s))
        return path

    old_env = fill(tmp_path / "cuda-0123456789ab", 3, age_s=300)
    (old_env / "fingerprint.json").write_text("{}")  # what makes a folder one of the pack's environments
    old_key = fill(env.artifacts_dir / "oldkey", 3, age_s=200)
    new_key = fill(env.artifacts_dir / "newkey", 3, age_s=100)
    # ACCEL_CACHE_DIR may name a folder that holds other things: never counted, never deleted (before, the
    # oldest folder of the root went first, whatever it was)
    not_ours = fill(tmp_path / "my-datasets", 3, age_s=900)
    # an environment another worker of a shared volume uses: its folder's time is old, its key's recent
    busy_env = tmp_path / "cuda-ba5ba5ba5ba5"
    busy_key = fill(busy_env / "artifacts" / "busykey", 3, age_s=50)
    (busy_env / "fingerprint.json").write_text("{}")
    os.utime(busy_env, (1e9 - 1000, 1e9 - 1000))
    monkeypatch.setenv(store.MAX_SIZE_ENV, str(7 / 1024))  # 7 MB: two of the four 3 MB entries must go
    env.evict_if_needed(force=True)
    assert not old_env.exists() and not old_key.exists() and new_key.exists() and busy_key.exists()
    assert env.stats["evicted"] == 2 and (not_ours / "blob").stat().st_size == 3 << 20

    # `python -m accel cache clear` deletes the environments and leaves the rest of the root (before, the command
    # deleted the whole root; refused while a compile of this process, an earlier test's background load, is in
    # its cache scope: tried again until it is not)
    cli = importlib.import_module(accel_pack.__name__ + ".accel.__main__")
    deadline = time.monotonic() + 120
    while cli.main(["cache", "clear"]) != 0:
        assert time.monotonic() < deadline, "the cache stayed busy"
        time.sleep(0.2)
    assert not env.dir.exists() and (not_ours / "blob").exists()


def test_unwritable_cache_dir_warns_once_and_the_prompt_completes(engine_and_nodes, tmp_path, monkeypatch, caplog):
    engine, comfy_nodes = engine_and_nodes
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ACCEL_CACHE_DIR", str(blocker / "cache"))
    family = families.BY_FAMILY["ltxv"]  # one block kind: a short compile
    model = families.load(comfy_nodes, family)
    eager = families.sample(model, family)
    # a key of its own (static shapes), so this test really compiles while the cache is unusable
    compiled = engine.compile_model(model, engine.CompileOptions(dynamic="static", choose="always compiled"))
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = families.sample(compiled, family)
        families.sample(compiled, family)
    assert_close_to_eager(out, eager, "compiled with an unwritable cache directory")
    warnings = [r.getMessage() for r in caplog.records if "compile cache: cannot write" in r.getMessage()]
    assert len(warnings) == 1 and "ACCEL_CACHE_DIR" in warnings[0], warnings
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ or str(blocker) not in os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_first_compiled_run_that_raises_falls_back_to_eager(engine_and_nodes, caplog):
    """A backend whose compiled code raises when it first runs (as a kernel that crashes on an older GPU would):
    the prompt completes with the eager output and one warning names what failed and the switch."""
    engine, comfy_nodes = engine_and_nodes
    if "accel_test_broken_kernel" not in torch._dynamo.list_backends(exclude_tags=()):
        @torch._dynamo.register_backend(name="accel_test_broken_kernel")
        def broken_kernel_backend(graph_module, example_inputs):
            def run(*args):
                raise RuntimeError("injected: the compiled kernel crashed on its first run")
            return run

    model = load(comfy_nodes)
    eager = sample(model)
    options = engine.CompileOptions(backend="accel_test_broken_kernel", choose="always compiled")
    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        out = sample(engine.compile_model(model, options))
    assert_close_to_eager(out, eager, "after a failing first run")
    warnings = [r.getMessage() for r in caplog.records if "runs eagerly because compiling it failed" in r.getMessage()]
    assert warnings and all("injected: the compiled kernel crashed" in w for w in warnings), warnings
    assert all("ACCEL_DISABLE_COMPILE=1" in w for w in warnings)
    broken = [k for k in engine.REGISTRY.stats()["kinds"] if "injected" in k["reason"]]
    assert broken and all(k["path"] == "eager" for k in broken)


def block_with_dtype_records(suffix: str) -> torch.nn.Sequential:
    """A seeded block of ComfyUI's own operation classes whose modules record each weight's dtype under
    `<weight name><suffix>`, as ComfyUI 0.33's loader does (model_management.archive_model_dtypes)."""
    import comfy.ops

    ops = comfy.ops.disable_weight_init
    torch.manual_seed(0)
    block = torch.nn.Sequential(ops.Linear(8, 16), torch.nn.GELU(), ops.Linear(16, 8))
    with torch.no_grad():  # these classes skip initialisation (a loader fills them): uninitialised memory held NaN
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    for module in block.modules():
        for name, param in module.named_parameters(recurse=False):
            setattr(module, f"{name}{suffix}", param.dtype)
    return block


def test_a_block_with_comfyui_033s_dtype_records_precompiles_and_loads(engine, comfy_dir):
    """ComfyUI 0.33 records each weight's dtype on its module when it loads a model (`weight_comfy_model_dtype`,
    its model_management.archive_model_dtypes). torch saved those as "missing" values by the dtype's identity, and
    every float32 tensor in the saved guards then loaded with no dtype: on 0.33 no block of any family could be
    precompiled, and every kind loaded through Dynamo in ComfyUI's process. A block of ComfyUI's own operation
    classes with those records, set as 0.33 sets them (0.3.75, the suite's default, has none): its precompiled
    function loads, its guards accept the call, its output equals eager, and the records are back on the modules."""
    import io

    block = block_with_dtype_records("_comfy_model_dtype")
    records = {(id(m), k): v for m in block.modules() for k, v in vars(m).items() if k.endswith("_comfy_model_dtype")}
    assert len(records) == 4
    x = torch.randn(2, 8)
    saving = importlib.import_module(f"{engine.__name__}.child.saving")  # the child's side (compile/child/)
    payload = saving.precompile(lambda b, x: b(x), {}, block, (x,), {}, set())
    function = torch.compiler.load_compiled_function(io.BytesIO(payload))  # raised TypeError (_Missing dtype)
    assert function.guard_check(block, x), "the loaded function's guards refused the call it was made for"
    torch.testing.assert_close(function.fn(block, x), block(x))
    assert records == {(id(m), k): v for m in block.modules() for k, v in vars(m).items()
                       if k.endswith("_comfy_model_dtype")}, "ComfyUI's dtype records were not put back"


def test_a_record_of_another_name_is_a_warning_not_a_silent_fallback(engine, comfy_dir, caplog, monkeypatch):
    """What a later ComfyUI could do: record the dtypes under another name, which LOAD_RECORD_SUFFIX does not set
    aside. A real background job (this process's compiler, its child) compiles the block, torch refuses to save it
    whole (the 0.33 TypeError), the child says torch refused, and this process warns once for the kind, naming what
    happened and the switch, where the stats' reason alone said it before. Switched off (ACCEL_PRECOMPILED=0), the
    same kind is no refusal."""
    def engine_module(name: str):  # the pack's modules as ComfyUI loaded them
        return importlib.import_module(f"{engine.__name__}.{name}")

    state = engine_module("background.state")
    block = block_with_dtype_records("_comfy_dtype_record")  # a name the pack does not know
    registry = engine_module("registry").GraphRegistry()
    entry = registry.entry(engine_module("blocks").BlockKind.of(block), type(block).forward, engine.CompileOptions(),
                           torch.device("cpu"))
    state._WARNED_NOT_PRECOMPILED.discard(entry.kind.label)
    entry.background.capture()
    with torch.inference_mode():
        capture = engine.background.Capture.in_this_call(entry, block, "forward")
        capture.add_call(("one call",), (torch.randn(2, 8),), {})
    background = engine.background.BACKGROUND
    cache = importlib.import_module(engine.__name__.rpartition(".")[0] + ".cache").COMPILE_CACHE

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and entry.kind.label in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="comfyui_accel"):
        assert background.launch([capture], cache.environment("cpu").dir)
        assert background.wait(timeout=300), "the background compile did not finish"
        assert entry.background.state is state.BackgroundState.DONE, entry.background.stats()
        assert "not precompiled (TypeError" in entry.background.reason, entry.background.reason
        (warning,) = warnings()
        assert "could not be saved whole" in warning and "TypeError" in warning and "ACCEL_PRECOMPILED=0" in warning
        again = state.KindBackground(entry.kind.label)  # a later job of the kind (a new shape) warns no more
        again.capture()
        again.sent()
        again.done(1.0, "TypeError: the same", refused=True)
        assert len(warnings()) == 1, warnings()

    monkeypatch.setenv("ACCEL_PRECOMPILED", "0")  # the same job item, compiled as the child does, in this process
    child = engine_module("child.compile_kind")
    switched_off = child.compile_item(capture.job_item(), engine_module("registry").GraphRegistry())
    assert not switched_off["precompile_refused"] and switched_off["precompiled"].startswith("off"), switched_off


@pytest.fixture(scope="module")
def engine_and_nodes(accel_pack, comfy_nodes):
    return accel_pack.accel.compile, comfy_nodes


def test_a_compile_in_the_prompts_process_is_saved_whole_and_a_restart_traces_nothing(tmp_path):
    """Issue #71's one compile path: with choose="always compiled" no child compiles anything (no background
    decision: the kinds compile in the prompt's process), and with ACCEL_SAVE_COMPILES on, as users have it, a
    child then saves their graphs whole after the call, as it saves what it compiles itself. A restart on that
    cache (a new process, the same settings) loads them at their first compiled call: no Dynamo frame, no child,
    the output equal to the first process's, bit for bit. The small SD1.5 UNet: its SpatialTransformer writes into
    its transformer_options as it runs, and a save that took the call's layouts after it served no later call
    (its graph guarded on the keys the block had added; found 2026-12-04 by bench/fleet_cache.py)."""
    cache = tmp_path / "cache"
    first, _ = run_probe(cache, tmp_path / "first.pt", saves=True, family=None)
    assert first["frames"] >= 3 and first["compiles"] >= 3, first  # compiled in the prompt's process
    jobs = first["background"]["finished"]
    assert len(jobs) == 1 and jobs[0]["returncode"] == 0 and not jobs[0]["failed"], first["background"]
    assert len(first["kinds"]) == 3, first["kinds"]
    for kind in first["kinds"]:
        assert kind["background"]["state"] == "done", kind
        assert kind["background"]["reason"].startswith("compiled in this process; a child process saved it"), kind
        assert "graphs precompiled" in kind["background"]["reason"], kind

    restart, _ = run_probe(cache, tmp_path / "restart.pt", saves=True, family=None)
    assert restart["frames"] == 0 and restart["compiles"] == 0, f"the restart traced: {restart}"
    assert restart["background"]["finished"] == [], "the restart started a child"
    for kind in restart["kinds"]:
        assert kind["precompiled"]["functions"] >= 1 and kind["precompiled"]["calls"] >= 1, kind
    assert torch.equal(torch.load(tmp_path / "restart.pt"), torch.load(tmp_path / "first.pt"))
