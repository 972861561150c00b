"""Every core ComfyUI node that takes a MODEL and returns a MODEL, run on a started server three ways: without the
pack, under Compile Model (always compiled; and its defaults) and under DeepCache at interval 1 (issue #70).

The nodes are found from the server's `/object_info` (python_module not custom_nodes.*), so a node a new ComfyUI
adds is covered without editing anything here. Each runs with its required inputs at their defaults; the inputs
that are not widgets are built from the generated test models (a second MODEL, a CLIP, a LATENT, an empty
CONDITIONING, a LATENT_OPERATION), and a node needing anything else (images, a VAE, a model patch file) is listed
as "cannot run here" with the reason. Outputs are the saved latents of a 2-step KSampler at a tiny size.

The eager and DeepCache ways of a family go in one prompt each (a branch whose node fails without the pack is
taken out and the prompt queued again: ComfyUI's cache keeps what already ran); Compile Model runs one prompt per
node, so the pack's stats before and after tell how that node's blocks ran (compiled calls, eager calls by reason).

    python -m tools.patch_matrix                      # the whole matrix on this ComfyUI: docs/patch_matrix/<v>.json
    python -m tools.patch_matrix --families sd15 --nodes FreeU,TomePatchModel --out /tmp/m.json
    python -m tools.patch_matrix --render             # docs/compatibility.md from docs/patch_matrix/*.json

tests/test_core_patches.py runs the fast subset of `make test` through `run_matrix` and asserts on its results.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.error
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tools.comfy_env import ROOT

MATRIX_DIR = ROOT / "docs" / "patch_matrix"
COMPAT_DOC = ROOT / "docs" / "compatibility.md"
STEPS, SEED = 2, 1
WIDGETS = ("INT", "FLOAT", "BOOLEAN", "STRING", "COMBO")
# Patches that change only the sampling around the model (its sampling object, CFG-style guidance, the sigmas,
# the denoise mask): under Compile Model every block call of theirs must run compiled (issue #70's target).
SAMPLING_ONLY = ("ModelSamplingAuraFlow", "ModelSamplingContinuousEDM", "ModelSamplingContinuousV",
                 "ModelSamplingDiscrete", "ModelSamplingFlux", "ModelSamplingLTXV", "ModelSamplingSD3",
                 "ModelSamplingStableCascade", "APG", "CFGNorm", "CFGZeroStar", "CFGOverride", "Mahiro", "RescaleCFG",
                 "TCFG", "FreSca", "RenormCFG", "VideoLinearCFGGuidance", "VideoTriangleCFGGuidance",
                 "LatentApplyOperationCFG", "DifferentialDiffusion", "Epsilon Scaling", "TemporalScoreRescaling",
                 "MiniMaxH3SigmaShift", "ModelNoiseScale", "PerpNeg")
# Nodes that run without the needed input types but are not patches to run at a test's size.
NOT_RUN = {"TrainLoraNode": "trains a LoRA (backward passes over a dataset): a training node, not a patch of the "
                            "sampling model",
           "TorchCompileModel": "core's torch.compile of the whole model: minutes of inductor compile per way on "
                                "the CPU (280 s a step here); Compile Model's own whole-model scope is tested in "
                                "tests/test_compile_model.py"}
ACCEL_WAYS = ("deepcache", "compiled", "defaults")
PATCHED_REASON = "another node patched the attention or the UNet"  # accel/compile/blocks.PATCHED
LORAS = {"sd15": "accel-sd15-lora.safetensors", "flux": "accel-flux-lora.safetensors"}


@dataclass(frozen=True)
class Family:
    name: str
    file_name: str
    cfg: float
    second_file: str | None = None  # a second model of the family for the merge nodes (else the same file)


def families() -> dict[str, Family]:
    from tools.families import BY_FAMILY

    found = {"sd15": Family("sd15", "accel-sd15-small.safetensors", 5.0, "accel-sd15-small-b.safetensors")}
    found.update({name: Family(name, case.file_name, case.cfg) for name, case in BY_FAMILY.items()})
    return found


# -- the nodes --------------------------------------------------------------------------------------------------

def input_type(spec) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, list) else str(kind)


def core_model_patches(object_info: dict) -> dict[str, dict]:
    """name -> object_info entry of every core node with a MODEL input and a MODEL output."""
    found = {}
    for name, node in object_info.items():
        if str(node.get("python_module", "")).startswith("custom_nodes"):
            continue
        required = node.get("input", {}).get("required", {})
        optional = node.get("input", {}).get("optional", {})
        types = [input_type(spec) for spec in {**required, **optional}.values()]
        if "MODEL" in types and "MODEL" in node.get("output", []):
            found[name] = node
    return dict(sorted(found.items()))


def widget_default(spec):
    """A required widget's default as the web UI sets it: its "default", else a combo's first option, a number's
    min (or 0); (False, reason) when there is none to take (an empty combo: no such file here)."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if isinstance(kind, list) or kind == "COMBO":
        choices = kind if isinstance(kind, list) else options.get("options", [])
        if "default" in options:
            return True, options["default"]
        return (True, choices[0]) if choices else (False, "its list is empty here (no such file among the test "
                                                          "models)")
    if "default" in options:
        return True, options["default"]
    return True, {"INT": options.get("min", 0), "FLOAT": options.get("min", 0.0), "BOOLEAN": False}.get(kind, "")


class Graph:
    """One prompt's nodes. Ids are unique over the prompts of a process (`prefix`): a Compile Model node's status,
    and so its block-call counts, are kept by its id."""
    prompts = 0

    def __init__(self, prefix: str = ""):
        self.nodes: dict[str, dict] = {}
        self.prefix = prefix

    def add(self, class_type: str, inputs: dict, node_id: str | None = None) -> str:
        node_id = node_id or f"{self.prefix}{len(self.nodes) + 1}"
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return node_id

    def branch(self, root: str) -> set[str]:
        """`root` and every node downstream of it."""
        found, grew = {root}, True
        while grew:
            grew = False
            for node_id, node in self.nodes.items():
                if node_id not in found and any(isinstance(v, list) and len(v) == 2 and v[0] in found
                                                for v in node["inputs"].values()):
                    found.add(node_id)
                    grew = True
        return found


@dataclass
class FamilyInputs:
    """The shared nodes of one family's prompt: its models, conditioning and latent."""
    family: Family
    graph: Graph
    model: list
    second: list
    clip: list
    positive: list
    negative: list
    latent: list


def family_inputs(family: Family, graph: Graph) -> FamilyInputs:
    model = [graph.add("UNETLoader", {"unet_name": family.file_name, "weight_dtype": "default"}), 0]
    second = model
    if family.second_file:
        second = [graph.add("UNETLoader", {"unet_name": family.second_file, "weight_dtype": "default"}), 0]
    clip = [graph.add("CLIPLoader", {"clip_name": "accel-clip-l.safetensors", "type": "stable_diffusion"}), 0]
    if family.name == "sd15":
        positive = [graph.add("CLIPTextEncode", {"clip": clip, "text": "a lighthouse on a cliff"}), 0]
        negative = [graph.add("CLIPTextEncode", {"clip": clip, "text": ""}), 0]
        latent = [graph.add("EmptyLatentImage", {"width": 128, "height": 128, "batch_size": 1}), 0]
    else:
        from tools.families import BY_FAMILY

        inputs = graph.add("AccelTestInputs", {"family": family.name, "seed": SEED,
                                               "tokens": min(BY_FAMILY[family.name].tokens, 16)})
        positive, negative, latent = [inputs, 0], [inputs, 1], [inputs, 2]
    return FamilyInputs(family, graph, model, second, clip, positive, negative, latent)


def patch_inputs(name: str, node: dict, fi: FamilyInputs) -> tuple[dict | None, str | None]:
    """The node's required inputs (defaults, and the family's own models and conditioning), or (None, why not)."""
    if name in NOT_RUN:
        return None, NOT_RUN[name]
    inputs, models = {}, 0
    for key, spec in node["input"].get("required", {}).items():
        kind = input_type(spec)
        if kind in WIDGETS:
            ok, value = widget_default(spec)
            if not ok:
                return None, f"input {key!r}: {value}"
            inputs[key] = value
        elif kind == "MODEL":
            inputs[key] = fi.model if models == 0 else fi.second
            models += 1
        elif kind == "CLIP":
            inputs[key] = fi.clip
        elif kind == "CONDITIONING":
            inputs[key] = fi.negative  # PerpNeg's empty conditioning
        elif kind == "LATENT":
            inputs[key] = fi.latent
        elif kind == "LATENT_OPERATION":
            inputs[key] = [fi.graph.add("LatentOperationTonemapReinhard", {"multiplier": 1.0}), 0]
        else:
            return None, f"needs a {kind} input ({key!r}), which the generated test models do not provide"
    if name.startswith("Lora"):
        lora = LORAS.get(fi.family.name)
        if lora is None:
            return None, f"no generated LoRA for {fi.family.name}"
        inputs["lora_name"] = lora
    return inputs, None


def sampled(fi: FamilyInputs, model: list, prefix: str) -> str:
    graph = fi.graph
    sampler = graph.add("KSampler", {"model": model, "seed": SEED, "steps": STEPS, "cfg": fi.family.cfg,
                                     "sampler_name": "euler", "scheduler": "normal", "positive": fi.positive,
                                     "negative": fi.negative, "latent_image": fi.latent, "denoise": 1.0})
    return graph.add("SaveLatent", {"samples": [sampler, 0], "filename_prefix": prefix})


def accel_node(graph: Graph, way: str, model: list) -> list:
    if way == "deepcache":
        return [graph.add("AccelDeepCache", {"model": model, "cache_interval": 1, "cache_depth": 0,
                                             "start_percent": 0.0, "end_percent": 1.0, "schedule": "uniform"}), 0]
    choose = {"choose": "always compiled"} if way == "compiled" else {}
    return [graph.add("AccelCompileModel", {"model": model, "mode": "default", "dynamic": "auto", "scope": "auto",
                                            **choose}), 0]


def model_output(name: str, node: dict) -> int:
    return list(node["output"]).index("MODEL")


# -- running ------------------------------------------------------------------------------------------------------

class PromptFailed(RuntimeError):
    def __init__(self, node_ids: list[str], message: str):
        super().__init__(message)
        self.node_ids, self.message = node_ids, message


def run_prompt(server, graph: dict, timeout: float = 3600) -> None:
    """Queue `graph` and wait for it; PromptFailed naming the nodes ComfyUI blamed (validation or execution)."""
    try:
        answer = server.post_json("/prompt", {"prompt": graph, "client_id": server.client_id})
    except urllib.error.HTTPError as err:
        body = json.loads(err.read().decode(errors="replace") or "{}")
        errors = body.get("node_errors") or {}
        raise PromptFailed(list(errors), "; ".join(e.get("message", "") + ": " + e.get("details", "")
                                                  for n in errors.values() for e in n.get("errors", []))
                           or json.dumps(body.get("error"))) from err
    prompt_id = answer["prompt_id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = server.get_json(f"/history/{prompt_id}").get(prompt_id) or {}
        status = entry.get("status", {})
        if status.get("completed"):
            return
        if status.get("status_str") == "error":
            for kind, data in status.get("messages", []):
                if kind == "execution_error":
                    raise PromptFailed([str(data.get("node_id"))], f"{data.get('node_type')}: "
                                       f"{data.get('exception_type')}: {str(data.get('exception_message')).strip()}")
            raise PromptFailed([], json.dumps(status.get("messages"))[-2000:])
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"ComfyUI died:\n{server.log_tail()}")
        time.sleep(0.05)
    raise RuntimeError(f"prompt {prompt_id} did not finish in {timeout:.0f} s")


def read_latent(server, prefix: str) -> torch.Tensor:
    from safetensors.torch import load_file

    files = sorted((server.base_dir / "output").glob(f"{prefix}_*.latent"))
    assert len(files) == 1, (prefix, files)
    return load_file(str(files[0]))["latent_tensor"].float()


@dataclass
class Case:
    node: str
    family: str
    way: str
    prefix: str
    patch_id: str | None = None  # the patch node's id in its prompt (None: the unpatched baseline)
    accel_id: str | None = None  # the pack's node's id in its prompt
    error: str | None = None
    latent: torch.Tensor | None = None
    counts: dict = field(default_factory=dict)
    status: dict | None = None


def _batch(server, fi: FamilyInputs, cases: list[Case]) -> None:
    """Run every case's branch of `fi.graph` in one prompt; a branch ComfyUI blames is taken out with its error."""
    graph = fi.graph
    while True:
        live = [c for c in cases if c.error is None]
        if not live:
            return
        try:
            run_prompt(server, graph.nodes)
            break
        except PromptFailed as failed:
            blamed = [c for c in live if c.patch_id in failed.node_ids or
                      any(node_id in graph.branch(c.patch_id or "") for node_id in failed.node_ids if c.patch_id)]
            if not blamed:  # a shared node or an unknown failure: report it for every case
                blamed = live
            for case in blamed:
                case.error = failed.message
                for node_id in graph.branch(case.patch_id) if case.patch_id else ():
                    graph.nodes.pop(node_id, None)
            if blamed is live:
                return
    for case in cases:
        if case.error is None:
            case.latent = read_latent(server, case.prefix)


def run_family(server, object_info: dict, family: Family, nodes: list[str], ways: tuple[str, ...],
               defaults_for: set[str] = frozenset()) -> list[Case]:
    """Every case of `nodes` on `family`: the unpatched baseline and each node without the pack, under DeepCache,
    always compiled, and with Compile Model's defaults (the nodes in `defaults_for`): one prompt per way. A Compile
    Model node's status (`/accel/status`) counts its own model's block calls, so each case's are told apart."""
    patches = core_model_patches(object_info)
    results: list[Case] = []
    for way in ("eager", "deepcache", "compiled", "defaults"):
        if way not in ways:
            continue
        Graph.prompts += 1
        fi = family_inputs(family, Graph(f"m{Graph.prompts}n"))
        batch = []
        for name in ["(none)", *nodes]:
            if way == "defaults" and name not in defaults_for and name != "(none)":
                continue
            case = Case(name, family.name, way, f"{family.name}-{way}-{Graph.prompts}-{len(batch) + len(results)}")
            model = fi.model
            if name != "(none)":
                inputs, why = patch_inputs(name, patches[name], fi)
                if inputs is None:
                    case.error = f"cannot run here: {why}"
                    results.append(case)
                    continue
                case.patch_id = fi.graph.add(name, inputs)
                model = [case.patch_id, model_output(name, patches[name])]
            if way != "eager":
                model = accel_node(fi.graph, way, model)
                case.accel_id = model[0]
            sampled(fi, model, case.prefix)
            batch.append(case)
        _batch(server, fi, batch)
        statuses = server.get_json("/accel/status") if way != "eager" else {}
        for case in batch:
            case.status = statuses.get(case.accel_id)
            if way in ("compiled", "defaults") and case.status:
                calls = case.status.get("calls") or {}
                case.counts = {"compiled_calls": calls.get("compiled", 0), "eager_calls": calls.get("eager", {})}
        results += batch
    return results


# -- verdicts -----------------------------------------------------------------------------------------------------

def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within the rounding of compiled float32 kernels (tests/compile_helpers.assert_close_to_eager)."""
    if actual.shape != expected.shape:
        return False
    scale = max(expected.abs().max().item(), 1.0)
    return bool(torch.allclose(actual, expected, rtol=1e-3, atol=2e-5 * scale))


def summarize(cases: list[Case], comfyui: str) -> dict:
    """The results as JSON: per node and family, each way's outcome and the node's verdict."""
    by_key = {(c.node, c.family, c.way): c for c in cases}
    nodes: dict[str, dict] = {}
    for (name, family, way), case in sorted(by_key.items()):
        if name == "(none)":
            continue
        eager = by_key.get((name, family, "eager"))
        base = by_key.get(("(none)", family, way if way == "eager" else "eager"))
        entry = nodes.setdefault(name, {"families": {}})["families"].setdefault(family, {})
        row = {"error": case.error}
        if case.latent is not None and eager is not None and eager.latent is not None:
            row["max_diff_vs_eager"] = float((case.latent - eager.latent).abs().max()) \
                if case.latent.shape == eager.latent.shape else None
            row["equal"] = close(case.latent, eager.latent)
            if way == "eager" and base is not None and base.latent is not None:
                row["changes_output"] = not close(case.latent, base.latent)
        if case.counts:
            row.update(case.counts)
        if case.status:
            row["status"] = {"state": case.status.get("state"), "text": case.status.get("text")}
        entry[way] = row
    for name, info in nodes.items():
        for family, ways in info["families"].items():
            ways["verdict"] = verdict(name, ways)
    return {"comfyui": comfyui, "torch": torch.__version__, "steps": STEPS, "nodes": nodes}


def _wrong(row: dict, feature: str, output: str) -> str | None:
    """The verdict of a way whose run failed or whose output is not the same patch's without the pack."""
    if row.get("error"):
        return f"WRONG: fails under {feature} ({row['error'][:160]})"
    if not row.get("equal"):
        return f"WRONG: {output} output differs (max {row.get('max_diff_vs_eager')})"
    return None


def verdict(name: str, ways: dict) -> str:
    """What the pack does with the node on a family, in a few words (docs/compatibility.md)."""
    eager = ways.get("eager", {})
    if eager.get("error"):
        text = eager["error"]
        return text if text.startswith("cannot run here") else f"cannot run here: fails without the pack ({text[:160]})"
    parts = []
    compiled = ways.get("compiled")
    if compiled:
        if wrong := _wrong(compiled, "Compile Model", "compiled"):
            return wrong
        eager_calls = compiled.get("eager_calls") or {}
        n_eager, n_compiled = sum(eager_calls.values()), compiled.get("compiled_calls", 0)
        if n_eager == 0 and n_compiled == 0:  # a run whose statuses gave no counts (before nodes/status.py did)
            parts.append("compiled output equal (block calls not counted in this run)")
        elif n_eager == 0:
            parts.append("compiled")
        elif n_compiled == 0:
            parts.append("eager: " + "; ".join(sorted(eager_calls)))
        else:
            parts.append(f"compiled, {n_eager} of {n_eager + n_compiled} block calls eager: "
                         + "; ".join(sorted(eager_calls)))
    deepcache = ways.get("deepcache")
    if deepcache:
        if wrong := _wrong(deepcache, "DeepCache", "DeepCache"):
            return wrong
        state = (deepcache.get("status") or {}).get("state")
        if state == "off":
            parts.append("DeepCache passes through: " + deepcache["status"]["text"])
    return "; ".join(parts) or "runs"


# -- the document -------------------------------------------------------------------------------------------------

def render(results: list[dict]) -> str:
    lines = ["# Compatibility: ComfyUI's own model patches under the pack", "",
             "Written by `python -m tools.patch_matrix --render` from `docs/patch_matrix/<ComfyUI>.json`, which "
             "`python -m tools.patch_matrix` writes (the whole matrix; `make test` runs a subset of it in "
             "`tests/test_core_patches.py`). Do not edit by hand.", "",
             "Every core node that takes a MODEL and returns a MODEL (found from the server's `/object_info`), run "
             f"with its default inputs on the generated test models, {STEPS} KSampler steps: without the pack, "
             "under Compile Model (`always compiled`) and under DeepCache (interval 1). Compiled and DeepCache "
             "outputs are compared with the same patch without the pack (compiled float32 rounding: rtol 1e-3). "
             "What each column says:", "",
             "- **compiled**: every block call ran compiled.",
             "- **compiled, n of m block calls eager: reason**: the calls the patch reaches (its attention patch, "
             "a guidance node's own extra call) ran eagerly, the rest compiled.",
             "- **eager: reason**: no block call ran compiled, for that reason. The output is still right.",
             "- **DeepCache passes through**: DeepCache refused the model, with that message on its node.",
             "- **cannot run here**: the node needs an input the test models do not give (images, a VAE, a model "
             "patch file), or fails without the pack at its defaults on that family (a patch for another model).",
             "- **changes output**: whether the patch at its defaults changed the latent at all (no: the check "
             "that the pack kept it is void for that node).", "",
             "## Other packs' patches", "",
             "A block call whose options hold another node's attention patch or replacement (`patches_replace` "
             "other than a DiT's per-block `dit` key), an attention override, or a patch key the pack does not know "
             "(one that is neither a known block patch nor one the model's own loop applies around its blocks, "
             "such as 0.33's `mlp_patch` inside Cosmos blocks) runs eagerly, as ComfyUI runs it, so the patch "
             "applies; so does a block whose `forward` another node set. The Compile Model node says so once, in "
             "one log line naming the node and the reason, counts it in `/accel/stats` "
             "(`compile_model.passed_through`), and its status (`/accel/status`) counts its model's block calls, "
             "compiled and eager by reason. Tested in `tests/test_core_patches.py`.", "",
             "DeepCache on a transformer runs a call in full, and says why, where reusing the skipped blocks' "
             "residual would add another node's work twice: a ControlNet's residuals (added after each block), a "
             "patch the block loop runs after every block (`double_block`: Qwen-Image's DiffSynth ControlNet), or "
             "another node's replacement of a skipped block's patch put on after DeepCache (PuLID-style nodes). The "
             "run's log has one line per reason naming the node, the reason and the calls; the run's report in "
             "`/accel/stats` counts them (`ran_full`); the node's status names them. The output then equals the "
             "model's without DeepCache. Tested in `tests/test_deepcache_dit.py` and `tests/test_conditioning_dit.py`.",
             "",
             "## Conditioning that changes the model call", "",
             "Tested on both ComfyUI versions (`tests/test_conditioning.py`, `tests/test_conditioning_dit.py`): "
             "Compile Model (`always compiled`) equals eager with every block call compiled and compiles nothing "
             "for a second prompt; DeepCache at interval 1 equals eager exactly, at interval 3 reuses on the "
             "planned steps (or runs in full with the reason, as above).", "",
             "| conditioning | model | Compile Model | DeepCache |", "| --- | --- | --- | --- |",
             "| ControlNet (ControlNetApplyAdvanced) | SD1.5 | compiled | reuses (the skipped blocks' control "
             "residuals are not seen on reused steps) |",
             "| ControlNet (ControlNetApplyAdvanced, a diffusers-format SD3 ControlNet with a VAE) | SD3 | compiled "
             "| runs in full: a ControlNet adds its residuals between the blocks DeepCache would skip |",
             "| area (ConditioningSetArea) | SD1.5 | compiled | reuses, per area |",
             "| mask (ConditioningSetMask) | SD1.5 | compiled | reuses |",
             "| image-to-video (WanImageToVideo: start image, CLIP vision output) | Wan 2.1 I2V | compiled | reuses |",
             "| first-last-frame (WanFirstLastFrameToVideo: two images, two CLIP vision outputs) | Wan 2.1 FLF2V "
             "| compiled | reuses |", "",
             "Not run here: Flux's ControlNets (ComfyUI detects them at Flux's full width, a 2 GB file; their "
             "residuals go in after each block as SD3's do, so DeepCache runs those calls in full the same way).",
             ""]
    for result in results:
        nodes = result["nodes"]
        families = sorted({f for info in nodes.values() for f in info["families"]})
        lines += [f"## ComfyUI {result['comfyui']} (torch {result['torch']}): {len(nodes)} nodes", "",
                  "| node | " + " | ".join(families) + " | changes output |",
                  "| --- | " + " | ".join("---" for _ in families) + " | --- |"]
        for name, info in nodes.items():
            cells = []
            changed = set()
            for family in families:
                ways = info["families"].get(family)
                cells.append("-" if ways is None else ways["verdict"].replace("|", "/"))
                if ways and ways.get("eager", {}).get("changes_output"):
                    changed.add(family)
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {', '.join(sorted(changed)) or 'no'} |")
        counts = Counter(v["verdict"].split(":")[0].split(",")[0] for info in nodes.values()
                         for v in info["families"].values())
        lines += ["", "Verdicts: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())), ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="sd15,sdxl,flux,wan21",
                        help="comma-separated (tools/families.py names and sd15)")
    parser.add_argument("--nodes", default="", help="comma-separated node names (default: every one found)")
    parser.add_argument("--ways", default="eager,deepcache,compiled")
    parser.add_argument("--defaults-for", default="", help="nodes also run under Compile Model's defaults "
                        "(comma-separated, or all)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="the server's compile cache (default: a new "
                        "one, so every graph compiles as on a fresh machine)")
    parser.add_argument("--out", type=Path, default=None, help="default docs/patch_matrix/<ComfyUI version>.json")
    parser.add_argument("--render", action="store_true", help="write docs/compatibility.md from the saved JSON")
    args = parser.parse_args(argv)
    if args.render:
        results = [json.loads(p.read_text()) for p in sorted(MATRIX_DIR.glob("*.json"))]
        COMPAT_DOC.write_text(render(results))
        print(f"wrote {COMPAT_DOC}")
        return
    from tools.comfy_env import comfyui_version
    from tools.soak_prompts import server_of

    base = Path(tempfile.mkdtemp(prefix="patch-matrix-"))
    env = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    if args.cache_dir:
        env["ACCEL_CACHE_DIR"] = str(args.cache_dir)
    with server_of(base, env=env) as server:
        info = server.get_json("/object_info")
        names = [n for n in args.nodes.split(",") if n] or list(core_model_patches(info))
        cases = []
        for name in args.families.split(","):
            start = time.monotonic()
            defaults = set(names) if args.defaults_for == "all" else set(args.defaults_for.split(","))
            ways = tuple(args.ways.split(",")) + (("defaults",) if args.defaults_for else ())
            cases += run_family(server, info, families()[name], names, ways, defaults)
            print(f"{name}: {time.monotonic() - start:.0f} s", flush=True)
        version = comfyui_version()
    out = args.out or MATRIX_DIR / f"{version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summarize(cases, version), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
