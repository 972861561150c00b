"""Build the pack's templates (example_workflows/, ComfyUI's UI workflow format, each with a thumbnail) from their
API-format copies (workflows_api/), through ComfyUI's own frontend in a real browser: the page opens each API file
as it opens a dropped one, lays the nodes out, and saves the graph as the frontend serialises it. Run after editing
a file in workflows_api/ (needs `make setup`):

    .venv/bin/python tools/make_templates.py

The Templates dialog lists example_workflows/ (ComfyUI serves it at /api/workflow_templates); the API copies are
what headless runs and comfy-cli take.
"""
from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.browser import comfy_page, fit_and_capture, load_api_workflow  # noqa: E402
from tools.comfy_server import ComfyServer  # noqa: E402

API_DIR = ROOT / "workflows_api"
TEMPLATE_DIR = ROOT / "example_workflows"
THUMBNAIL_WIDTH = 640


def template_name(api_file: Path) -> str:
    return api_file.stem.removesuffix("_api")


def main() -> None:
    TEMPLATE_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as base, ComfyServer(Path(base)) as server, comfy_page(server) as page:
        for api_file in sorted(API_DIR.glob("*_api.json")):
            name = template_name(api_file)
            load_api_workflow(page, json.loads(api_file.read_text()), name)
            # Serialised in the page: JSON drops the fields the frontend leaves undefined, where a value handed
            # to Python would come back as null, which the frontend's schema refuses when it loads the file.
            workflow = json.loads(page.evaluate("() => JSON.stringify(window.app.graph.serialize())"))
            workflow.setdefault("extra", {})["ds"] = fitting_view(workflow["nodes"])
            jpeg = fit_and_capture(page)
            (TEMPLATE_DIR / f"{name}.json").write_text(json.dumps(workflow, indent=1) + "\n")
            save_thumbnail(jpeg, TEMPLATE_DIR / f"{name}.jpg")
            print(f"[templates] {name}: {len(workflow['nodes'])} nodes", flush=True)


def fitting_view(nodes: list[dict], screen=(1400, 800)) -> dict:
    """The opening view (LiteGraph's scale and offset) that shows every node on a common laptop screen."""
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] for n in nodes) - 40
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    scale = round(min(1.0, 0.9 * min(screen[0] / (x1 - x0), screen[1] / (y1 - y0))), 3)
    return {"scale": scale, "offset": [round(screen[0] / (2 * scale) - (x0 + x1) / 2, 1),
                                       round(screen[1] / (2 * scale) - (y0 + y1) / 2, 1)]}


def save_thumbnail(jpeg: bytes, path: Path) -> None:
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as image:
        height = round(image.height * THUMBNAIL_WIDTH / image.width)
        image.convert("RGB").resize((THUMBNAIL_WIDTH, height), Image.LANCZOS).save(path, quality=85)


if __name__ == "__main__":
    main()
