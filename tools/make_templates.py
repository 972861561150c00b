"""Build the pack's templates (example_workflows/, ComfyUI's UI workflow format, each with a thumbnail) from their
API-format copies (workflows_api/), through ComfyUI's own frontend in a real browser: the page opens each API file
as it opens a dropped one, lays the nodes out, and saves the graph as the frontend serialises it. Each loader
node gets the links of its real model files (`properties.models`, as ComfyUI's own templates carry them) and the
workflow the list of all of them (`models`), so the frontend's missing-models dialog names and offers them
(tools/template_models.py). Run after editing a file in workflows_api/ (needs `make setup`):

    .venv/bin/python tools/make_templates.py [--thumbnails-only]

The frontend's template browser lists example_workflows/ (ComfyUI serves it at /api/workflow_templates) under
Extensions > ComfyUI-Accel, with the file name as the card's title (it takes no title or description from a pack:
docs/ui/ shows it), so each file is named for what it does; the thumbnail is a card saying the same. The API
copies are what headless runs and comfy-cli take.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.template_models import links_of  # noqa: E402

API_DIR = ROOT / "workflows_api"
TEMPLATE_DIR = ROOT / "example_workflows"
THUMBNAIL_SIZE = 512  # the template browser shows thumbnails square


@dataclass(frozen=True)
class Template:
    api_name: str  # workflows_api/<api_name>_api.json
    title: str  # example_workflows/<title>.json: the template browser's card title
    family: str  # the card's headline
    task: str
    nodes: tuple[str, ...]  # the Accel nodes (and what they act with) the card lists
    what: str  # one sentence on the card


TEMPLATES = (
    Template("sd15_text_to_image", "SD1.5 text to image - Compile Model, DeepCache, Compile VAE", "SD1.5",
             "text to image", ("Compile Model", "DeepCache", "Compile VAE"),
             "ComfyUI's default workflow, accelerated: compiled blocks, deep features reused while they barely "
             "move, a compiled VAE decode."),
    Template("sdxl_text_to_image", "SDXL text to image - Compile Model, DeepCache, Compile VAE", "SDXL 1.0",
             "text to image", ("Compile Model", "DeepCache", "Compile VAE"),
             "SDXL base at 1024x1024 with compiled blocks, DeepCache's auto schedule and a compiled VAE decode."),
    Template("flux_dev_text_to_image", "Flux.1 dev text to image - Compile Model, DeepCache", "Flux.1 dev",
             "text to image", ("Compile Model", "DeepCache"),
             "Flux dev with compiled transformer blocks; DeepCache (auto) reuses the blocks after the first only "
             "while the features barely move."),
    Template("wan21_text_to_video", "Wan 2.1 text to video 1.3B - Compile Model, DeepCache", "Wan 2.1 1.3B",
             "text to video", ("Compile Model", "DeepCache"),
             "A 33-frame 832x480 clip with compiled blocks and DeepCache's auto schedule, saved as a video."),
    Template("qwen_image_text_to_image", "Qwen-Image text to image - Compile Model, DeepCache", "Qwen-Image",
             "text to image", ("Compile Model", "DeepCache"),
             "Qwen-Image's 20-step workflow with compiled blocks and DeepCache's auto schedule."),
    Template("qwen_image_lightning_lora", "Qwen-Image Lightning LoRA 8 steps - LoRA under Compile Model",
             "Qwen-Image", "8 steps with a LoRA", ("LoRA", "Compile Model"),
             "The Lightning LoRA under Compile Model: weights are graph inputs, so a LoRA or its strength "
             "changes without a recompile."),
    Template("sdxl_swap_base_and_turbo", "SDXL base then Turbo - Swap Weights, one compile", "SDXL + Turbo",
             "two checkpoints", ("Compile Model", "Swap Weights"),
             "One compiled SDXL samples with the base weights, then with SDXL Turbo's: a weight copy with no "
             "recompile, never two models in memory (Turbo's 512x512 at cfg 1 is a new shape: compiled once, in "
             "the background)."),
)


def template_id(template: Template) -> str:
    """The template's own workflow id, the same in every build. The frontend keeps a workflow's id when it opens
    the file and sends it with each prompt; the pack's statuses show only on the workflow whose prompt made them.
    An API file opened in the page gets the zero id, which every template had: one template's statuses showed
    on another's nodes of the same ids."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL,
                          f"https://github.com/comfyui-accel/ComfyUI-Accel/example_workflows/{template.api_name}"))


def add_model_links(workflow: dict) -> dict:
    """Each loader node's real files as `properties.models`, and all of them as the workflow's `models`: the
    two places ComfyUI's frontend reads them from (its missing-models dialog, frontend 1.32 and 1.53)."""
    found = {}
    for node in workflow["nodes"]:
        links = links_of(node.get("widgets_values"))
        if links:
            node.setdefault("properties", {})["models"] = links
            found.update({link["name"]: link for link in links})
    workflow["models"] = [found[name] for name in sorted(found)]
    return workflow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--thumbnails-only", action="store_true", help="draw the cards again, nothing else")
    args = parser.parse_args()
    TEMPLATE_DIR.mkdir(exist_ok=True)
    for template in TEMPLATES:
        draw_card(template).save(TEMPLATE_DIR / f"{template.title}.jpg", quality=90)
    if args.thumbnails_only:
        return
    from tools.browser import comfy_page, load_api_workflow
    from tools.comfy_env import comfyui_dir
    from tools.comfy_server import ComfyServer
    from tools.template_models import standins_dir

    with tempfile.TemporaryDirectory() as base, \
            ComfyServer(Path(base), standins=standins_dir(comfyui_dir())) as server, comfy_page(server) as page:
        for template in TEMPLATES:
            graph = json.loads((API_DIR / f"{template.api_name}_api.json").read_text())
            load_api_workflow(page, graph, template.title)
            # Serialised in the page: JSON drops the fields the frontend leaves undefined, where a value handed
            # to Python would come back as null, which the frontend's schema refuses when it loads the file.
            workflow = json.loads(page.evaluate("() => JSON.stringify(window.app.graph.serialize())"))
            workflow["id"] = template_id(template)
            workflow.setdefault("extra", {})["ds"] = fitting_view(workflow["nodes"])
            add_model_links(workflow)
            (TEMPLATE_DIR / f"{template.title}.json").write_text(json.dumps(workflow, indent=1) + "\n")
            print(f"[templates] {template.title}: {len(workflow['nodes'])} nodes, "
                  f"{len(workflow['models'])} model links", flush=True)
    known = {f"{t.title}{suffix}" for t in TEMPLATES for suffix in (".json", ".jpg")}
    for stale in TEMPLATE_DIR.iterdir():  # a renamed template's old files
        if stale.name not in known:
            stale.unlink()


def fitting_view(nodes: list[dict], screen=(1400, 800)) -> dict:
    """The opening view (LiteGraph's scale and offset) that shows every node on a common laptop screen."""
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] for n in nodes) - 40
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    scale = round(min(1.0, 0.9 * min(screen[0] / (x1 - x0), screen[1] / (y1 - y0))), 3)
    return {"scale": scale, "offset": [round(screen[0] / (2 * scale) - (x0 + x1) / 2, 1),
                                       round(screen[1] / (2 * scale) - (y0 + y1) / 2, 1)]}


# The card: the pack's green for its nodes (web/accel.js colours Accel nodes the same), on ComfyUI's dark grey.
BACKGROUND, PANEL, ACCENT, TEXT, MUTED = "#202020", "#2b2b2b", "#2a4d3e", "#f0f0f0", "#a8a8a8"


def draw_card(template: Template):
    """The template's thumbnail: the model family, the task, the Accel nodes it uses and one line on what it does."""
    from PIL import Image, ImageDraw

    size = THUMBNAIL_SIZE
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, size, 10), fill=ACCENT)
    draw.text((32, 34), template.family, font=_font(46, bold=True), fill=TEXT)
    draw.text((32, 92), template.task, font=_font(28), fill=MUTED)
    y = 146
    for node in template.nodes:
        draw.rounded_rectangle((32, y, size - 32, y + 44), radius=10, fill=ACCENT)
        draw.text((50, y + 9), node, font=_font(24, bold=True), fill=TEXT)
        y += 54
    lines = textwrap.wrap(template.what, 38)
    bottom = size - 50
    if y + 16 + 28 * len(lines) > bottom:
        raise ValueError(f"{template.title}: its card's sentence is too long ({len(lines)} lines)")
    draw.rounded_rectangle((24, y + 4, size - 24, bottom), radius=10, fill=PANEL)
    for i, line in enumerate(lines):
        draw.text((40, y + 16 + 28 * i), line, font=_font(20), fill=TEXT)
    draw.text((32, size - 38), "ComfyUI-Accel template", font=_font(18), fill=MUTED)
    return image


def _font(size: int, bold: bool = False):
    """DejaVu Sans, which matplotlib (a test requirement) ships: the same picture on every machine."""
    import matplotlib
    from PIL import ImageFont

    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    return ImageFont.truetype(str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / name), size)


if __name__ == "__main__":
    main()
