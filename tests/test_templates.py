"""The pack's templates and node docs as a user meets them, in a real browser (Debian's Chromium driven by
Playwright) on a started ComfyUI server with the pack in custom_nodes and the templates' real file names present
as generated stand-ins (tools/template_models.py):
- every template opens from the frontend's template browser (Extensions > ComfyUI-Accel) with its thumbnail, and
  without a warning; each loader node carries the links of its real files, each of the pack's nodes a saved value
  for every widget it has today;
- each runs to its image or video: the text encoders too large to generate here (T5-XXL, umT5-XXL, Qwen2.5-VL)
  are replaced by conditioning of their width, and sizes, frames and steps are cut to a CPU's test budget; every
  other node runs as shipped;
- with one model file absent, the frontend's missing-models dialog names it with its link;
- the docs panel of each Accel node shows its markdown (web/docs/), and every input has a tooltip.

ACCEL_SCREENSHOT_DIR=docs/ui keeps the screenshots (the template browser, the missing-models dialog, a node's docs).
Runs in CI on ComfyUI 0.3.75's frontend (1.32) and on 0.33.0's (1.49) (see test_web_ui.py).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tools.browser import comfy_page
from tools.comfy_env import ROOT, comfyui_dir
from tools.comfy_server import ComfyServer
from tools.make_templates import TEMPLATES, template_id
from tools.template_models import BY_NAME, PLACEHOLDERS, standins_dir
from ui_pages import error_dialogs, page_prompt, screenshot

pytestmark = pytest.mark.server
TEST_INPUTS = ROOT / "tools" / "server_nodes" / "accel_test_inputs"
ACCEL_NODES = {"AccelCompileModel": "Compile Model (Accel)", "AccelCompileVAE": "Compile VAE (Accel)",
               "AccelDeepCache": "DeepCache (Accel)", "AccelSwapWeights": "Swap Weights (Accel)"}
# The conditioning that replaces a placeholder text encoder's: the generated family of the template's model.
FAMILY_OF_ENCODER = {"t5xxl_fp16.safetensors": "flux", "umt5_xxl_fp8_e4m3fn_scaled.safetensors": "wan21",
                     "qwen_2.5_vl_7b_fp8_scaled.safetensors": "qwen_image"}
# What a 2-core CPU samples in seconds with the stand-ins: the seven templates ran to their outputs in 89 s at
# 128x128, 133 s at 256x256 (2026-11-29, those tests alone); what is checked (a file per save node, the
# video's frames) does not depend on the size.
TEST_SIZE, TEST_STEPS, TEST_FRAMES = 128, 4, 5
SIZED = {"EmptyLatentImage", "EmptySD3LatentImage", "EmptyHunyuanLatentVideo"}


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> Path:
    """The stand-ins, as links in a folder of this module's own (a test takes one away)."""
    folder = tmp_path_factory.mktemp("standins")
    source = standins_dir(comfyui_dir())
    for path in source.rglob("*.safetensors"):
        link = folder / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path.resolve())
    missing = sorted(set(BY_NAME) - {p.name for p in folder.rglob("*.safetensors")})
    assert not missing, f"stand-ins not written (make setup writes them): {missing}"
    return folder


@pytest.fixture(scope="module")
def ui(tmp_path_factory, standins):
    base = tmp_path_factory.mktemp("templates-ui")
    with ComfyServer(base, extra_nodes=(TEST_INPUTS,), standins=standins) as server, comfy_page(server) as page:
        yield server, page


def close_dialogs(page, timeout: float = 10) -> None:
    """Each dialog still open or closing closed first, as far as it closes (the template browser animates out after
    a card's click on 0.33.0's frontend, where a locator of the next one could take the old one for it; frontend
    1.32 of 0.3.75 closes it by its close button, not Escape, and opens the next one over it if it stays)."""
    visible = page.locator(".workflow-template-selector-dialog, [role=dialog]").filter(visible=True)
    deadline = time.monotonic() + timeout
    while visible.count() and time.monotonic() < deadline:
        page.keyboard.press("Escape")
        time.sleep(0.3)
        close = visible.first.locator(".p-dialog-close-button, .p-dialog-header-close, [aria-label=Close]")
        if visible.count() and close.count() and close.first.is_visible():
            close.first.click()
            time.sleep(0.3)


# The pack's entry in the newest open template browser's left list, clicked in one turn of the page's own event
# loop: on 0.33.0's frontend the list re-renders while the extensions' templates load, and a locator's click
# (resolve, wait until stable, click) then found its element detached until it timed out (2026-12-03).
CLICK_PACK_ENTRY = """() => {
    const dialogs = [...document.querySelectorAll('.workflow-template-selector-dialog, [role=dialog]')]
        .filter(d => d.getClientRects().length > 0);
    const dialog = dialogs[dialogs.length - 1];
    const entry = dialog && [...dialog.querySelectorAll('[role=button]')]
        .find(b => b.innerText.trim() === 'ComfyUI-Accel' && b.getClientRects().length > 0);
    if (!entry) return false;
    entry.click();
    return true;
}"""


def open_template_browser(page) -> None:
    """The frontend's template browser, on the pack's own page (Extensions > ComfyUI-Accel)."""
    close_dialogs(page)
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    dialog = page.locator(".workflow-template-selector-dialog, [role=dialog]").filter(visible=True).last
    dialog.wait_for(timeout=30_000)
    # The extensions' entries come after the dialog opens (0.33.0's frontend lists them once their templates
    # loaded): a look at once may miss the entry, and a click on its group's name then folds it away. So the
    # group's name is clicked only after a moment without the entry, and again (it toggles) after each 5 s more.
    start = time.monotonic()
    clicks = 0
    while not page.evaluate(CLICK_PACK_ENTRY):
        waited = time.monotonic() - start
        if waited > 30:
            raise AssertionError(f"the template browser has no ComfyUI-Accel entry: its buttons "
                                 f"{[b.inner_text() for b in dialog.get_by_role('button').all()][:40]}")
        if waited > 2 + 5 * clicks:
            dialog.get_by_text("Extensions", exact=True).first.click()  # a folded group
            clicks += 1
        time.sleep(0.2)


def card(page, title: str):
    return page.locator(f'[data-testid="template-workflow-{title}"]')


def loaded_nodes(page) -> list[dict]:
    return page.evaluate("""() => window.app.graph._nodes.map(n => ({id: String(n.id), type: n.type,
        models: n.properties?.models ?? null,
        widgets: (n.widgets ?? []).filter(w => w.serialize !== false).map(w => w.value)}))""")  # the saved ones


def test_every_template_opens_from_the_template_browser_with_its_model_links(ui):
    server, page = ui
    listed = server.get_json("/api/workflow_templates")["comfyui-accel"]
    assert sorted(listed) == sorted(t.title for t in TEMPLATES), listed
    assert len({template_id(t) for t in TEMPLATES}) == len(TEMPLATES)
    open_template_browser(page)  # as a user first sees it: the cards in view, their thumbnails loaded
    page.wait_for_function("""() => [...document.querySelectorAll('[data-testid^="template-workflow-"] img')]
        .filter(img => img.complete && img.naturalWidth > 0).length >= 3""", timeout=30_000)
    screenshot(page, "template_browser")
    page.keyboard.press("Escape")
    for template in TEMPLATES:
        open_template_browser(page)
        found = card(page, template.title)
        found.wait_for(timeout=30_000)
        assert template.title in found.inner_text()
        found.scroll_into_view_if_needed()  # thumbnails load when their card is in view
        image = found.locator("img").first
        page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=image.element_handle(),
                               timeout=30_000)
        api_copy = json.loads((ROOT / "workflows_api" / f"{template.api_name}_api.json").read_text())
        expected = sorted(v["class_type"] for v in api_copy.values())
        found.click()
        page.wait_for_function("""(types) => !document.querySelector('.workflow-template-selector-dialog')
            && JSON.stringify(window.app.graph._nodes.map(n => n.type).sort()) === JSON.stringify(types)""",
                               arg=expected, timeout=30_000)  # the template's graph, all its nodes
        time.sleep(0.5)
        assert not error_dialogs(page), f"{template.title}: {error_dialogs(page)}"
        # its own workflow id, which the frontend keeps and sends with its prompts: one template's statuses show
        # on no other template's nodes of the same ids
        assert page.evaluate("() => window.app.graph.id") == template_id(template), template.title
        nodes = loaded_nodes(page)
        saved = {str(n["id"]): n.get("widgets_values", []) for n in json.loads(
            (ROOT / "example_workflows" / f"{template.title}.json").read_text())["nodes"]}
        for node in nodes:  # the pack's nodes as they are today: a value saved for each of their widgets
            if node["type"] in ACCEL_NODES:
                assert len(saved[node["id"]]) == len(node["widgets"]), \
                    (f"{template.title}: {node['type']} saved with {len(saved[node['id']])} widget values of "
                     f"{len(node['widgets'])}: run tools/make_templates.py")
        for node in nodes:  # each real file a node names comes with its link, as ComfyUI's templates carry it
            named = [v for v in node["widgets"] if isinstance(v, str) and v in BY_NAME]
            assert [m["name"] for m in node["models"] or []] == named, node
            for link in node["models"] or []:
                assert link == BY_NAME[link["name"]].link(), link


def runnable(prompt: dict) -> dict:
    """The template's prompt with the placeholder text encoders' nodes replaced by conditioning of their width
    (tools/server_nodes/accel_test_inputs), and sizes, frames and steps cut to the test budget."""
    prompt = json.loads(json.dumps(prompt))
    for node_id, node in list(prompt.items()):
        names = [v for v in node["inputs"].values() if isinstance(v, str) and v in PLACEHOLDERS]
        if not names:
            continue
        inputs_id = f"{node_id}-inputs"
        prompt[inputs_id] = {"class_type": "AccelTestInputs",
                             "inputs": {"family": FAMILY_OF_ENCODER[names[-1]], "seed": 0, "tokens": 77}}
        del prompt[node_id]
        for other_id, other in list(prompt.items()):  # each text encode reading it: the conditioning instead
            if other["class_type"] == "CLIPTextEncode" and other["inputs"].get("clip") == [node_id, 0]:
                negative = any(n["inputs"].get("negative") == [other_id, 0] for n in prompt.values())
                del prompt[other_id]
                for reader in prompt.values():
                    for key, value in reader["inputs"].items():
                        if value == [other_id, 0]:
                            reader["inputs"][key] = [inputs_id, 1 if negative else 0]
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] in SIZED:
            inputs["width"] = inputs["height"] = TEST_SIZE
            if "length" in inputs:
                inputs["length"] = TEST_FRAMES
        if "steps" in inputs:
            inputs["steps"] = min(inputs["steps"], TEST_STEPS)
    return prompt


def outputs_of(server, entry: dict) -> list[Path]:
    """The files the prompt wrote (images, and videos, which ComfyUI lists as "images" with animated set)."""
    files = []
    for output in entry["outputs"].values():
        for item in output.get("images", []) + output.get("videos", []):
            files.append(server.base_dir / "output" / item.get("subfolder", "") / item["filename"])
    return files


# Two templates run to their images in the full tier only (tests/conftest.py); make test opens every template in
# the template browser and runs the others.
_RUN_IN_FULL = {
    "sdxl_text_to_image": pytest.mark.full(why=(
        "SDXL's text-to-image template run to its image; make test opens it in the template browser and runs "
        "SDXL's stand-in under Compile Model in the SDXL base-then-Turbo template "
        "([sdxl_swap_base_and_turbo])")),
    "flux_dev_text_to_image": pytest.mark.full(why=(
        "Flux's template run to its image (Compile Model's defaults, DeepCache); make test opens it in the "
        "template browser, compiles Flux in test_compile_flux.py and runs it under DeepCache and Compile Model in "
        "test_dit_deepcache_with_compile_model_recompiles_nothing_after_the_first_run[flux]"))}


@pytest.mark.parametrize("template", [pytest.param(t, marks=_RUN_IN_FULL.get(t.api_name, ())) for t in TEMPLATES],
                         ids=lambda t: t.api_name)
def test_each_template_runs_to_its_output(ui, template):
    server, page = ui
    page.evaluate("""async (name) => {
        const response = await window.comfyAPI.api.api.fetchApi(`/workflow_templates/comfyui-accel/${name}.json`);
        await window.app.loadGraphData(await response.json(), true, true, name);
    }""", template.title)
    prompt = runnable(page_prompt(page))
    entry = server.run_workflow(prompt, timeout=600)
    written = outputs_of(server, entry)
    saves = [n for n in prompt.values() if n["class_type"] in ("SaveImage", "SaveVideo")]
    assert len(written) == len(saves) and all(p.is_file() and p.stat().st_size > 0 for p in written), entry
    if any(n["class_type"] == "SaveVideo" for n in saves):
        import av

        (video,) = written
        with av.open(str(video)) as container:
            frames = sum(1 for _ in container.decode(video=0))
        assert frames == TEST_FRAMES, (video, frames)


def test_a_missing_model_is_named_with_its_link(ui, standins):
    """The frontend's own missing-models warning (a dialog on 1.32, the Issues panel's group on 1.49+) names an
    absent file and offers its link."""
    server, page = ui
    close_dialogs(page)  # the toast's button is under any dialog an earlier test left
    template = TEMPLATES[0]
    name = "v1-5-pruned-emaonly-fp16.safetensors"
    absent = standins / BY_NAME[name].directory / name
    target = absent.resolve()
    absent.unlink()
    try:
        # The user's refresh (R): the frontend reads the loaders' file lists again (frontend 1.49+ flags a file a
        # loader's list lacks; 1.32 asks the server's model folders), and its toast saying so goes.
        page.evaluate("async () => { await window.app.refreshComboInNodes(); }")
        page.locator(".p-toast-message").first.wait_for(state="detached", timeout=30_000)
        page.evaluate("""async (name) => {
            const response = await window.comfyAPI.api.api.fetchApi(`/workflow_templates/comfyui-accel/${name}.json`);
            await window.app.loadGraphData(await response.json(), true, true, name);
        }""", template.title)
        warning = page.locator(".comfy-missing-models, [data-testid=error-group-missing-model], "
                               "[data-testid=error-overlay]").first
        warning.wait_for(timeout=30_000)
        if page.locator("[data-testid=error-overlay-see-errors]").count():  # 1.49+: the toast, then the panel
            page.locator("[data-testid=error-overlay-see-errors]").first.click()
            page.locator("[data-testid=error-group-missing-model]").first.wait_for(timeout=30_000)
        text = page.locator("body").inner_text()
        assert name in text, text[-2000:]
        screenshot(page, "missing_models")
        link = BY_NAME[name].url
        offered = page.evaluate("""(url) => [...document.querySelectorAll('[title]')].some(e => e.title === url)
            || document.body.innerHTML.includes(url)""", link)
        if not offered:  # 1.49+ shows the link behind its Copy URL button and the Download button
            assert page.locator("[data-testid=missing-model-download]").count(), text[-2000:]
        page.keyboard.press("Escape")
    finally:
        absent.symlink_to(target)


def test_every_accel_node_shows_its_docs_in_the_docs_panel(ui):
    server, page = ui
    for node_class, display in ACCEL_NODES.items():
        page.evaluate("""(type) => {
            const graph = window.app.graph;
            graph.clear();
            const node = (window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).createNode(type);
            const canvas = window.app.canvas;  // right of the middle of the view: clear of the docs panel
            const [x, y] = canvas.ds.convertOffsetToCanvas([canvas.canvas.width * 0.6, canvas.canvas.height * 0.4]);
            node.pos = [x, y];
            graph.add(node);
            window.app.canvas.deselectAll?.();
            window.app.canvas.selectNode(node);
            window.app.canvas.setDirty(true, true);
        }""", node_class)
        info = page.locator("[data-testid=info-button]").first  # the selection toolbox's button
        info.wait_for(timeout=30_000)
        info.dispatch_event("click")  # the docs panel of the node before may lie over it
        docs = page.locator(".node-help-content .markdown-content").first
        docs.wait_for(timeout=30_000)
        page.wait_for_function("(title) => [...document.querySelectorAll('.node-help-content .markdown-content h1')]"
                               ".some(h => h.textContent.trim() === title)", arg=display, timeout=30_000)
        text = docs.inner_text()
        assert "Inputs" in text and "Status line" in text, text[:1000]
        if node_class == "AccelDeepCache":
            screenshot(page, "node_docs")
    for node_class in ACCEL_NODES:  # served where the frontend looks for them
        answer = page.request.get(f"{server.url}/extensions/comfyui-accel/docs/{node_class}.md")
        assert answer.ok, node_class


def test_every_input_of_every_accel_node_has_a_tooltip(ui):
    server, _ = ui
    info = server.get_json("/object_info")
    for node_class in ACCEL_NODES:
        for section in ("required", "optional"):
            for name, spec in info[node_class]["input"].get(section, {}).items():
                options = spec[1] if len(spec) > 1 else {}
                assert options.get("tooltip"), f"{node_class}.{name} has no tooltip"
