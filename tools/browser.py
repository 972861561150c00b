"""A real browser on a started ComfyUI server: Debian's Chromium driven by Playwright for Python, for the browser
tests and the template builder. Playwright's own browser download cannot work on the project's machines, so it is
pointed at the system binary (installed by `make setup`: tools/setup_env.py).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
APP_READY = "window.app && window.app.graph && window.app.canvas"


def chromium_path() -> str | None:
    """The system Chromium: $ACCEL_CHROMIUM, else the first one on PATH."""
    configured = os.environ.get("ACCEL_CHROMIUM")
    if configured:
        return configured if Path(configured).exists() else None
    return next((found for name in CHROMIUM_CANDIDATES if (found := shutil.which(name))), None)


MISSING_CHROMIUM = ("no Chromium found: `make setup` installs Debian's package (apt-get install chromium); elsewhere "
                    "install one and put it on PATH, or set ACCEL_CHROMIUM to its binary")


@contextlib.contextmanager
def comfy_page(server, viewport=(1400, 900)):
    """A page with ComfyUI's frontend open on `server` and ready (window.app exists); console messages and failed
    requests collected in page.accel_log as (kind, text) pairs. The first-run templates dialog is turned off
    through ComfyUI's own settings route, and the Nodes 2.0 banner dismissed, as a returning user has them."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    if executable is None:
        raise RuntimeError(MISSING_CHROMIUM)
    server.post_json("/settings/Comfy.TutorialCompleted", True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            page.accel_log = []
            page.on("console", lambda m: page.accel_log.append((m.type, m.text)))
            page.on("pageerror", lambda e: page.accel_log.append(("pageerror", str(e))))
            page.on("requestfailed", lambda r: page.accel_log.append(("requestfailed", r.url)))
            page.on("response", lambda r: r.status >= 400 and page.accel_log.append(("http", f"{r.status} {r.url}")))
            # the frontend's "Introducing Nodes 2.0" banner, dismissed as a returning user has it (its own key)
            page.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
            page.goto(server.url)
            page.wait_for_function(APP_READY, timeout=90_000)
            yield page
        finally:
            browser.close()


# The id the frontend gives a workflow opened from an API file (1.32 and 1.49 alike): it has none of its own (the
# pack names its statuses as no workflow's: nodes/common.NO_WORKFLOW_ID).
API_WORKFLOW_ID = "00000000-0000-0000-0000-000000000000"
SHOWN = """([types, id]) => {
    const graph = window.app.graph, nodes = graph._nodes;
    return graph.id === id && JSON.stringify(nodes.map(n => n.type).sort()) === JSON.stringify(types)
        && new Set(nodes.map(n => n.pos.join())).size > 1;
}"""


def load_api_workflow(page, graph: dict, name: str) -> None:
    """Open an API-format workflow in the page as the frontend does for one dropped in (app.loadApiJson)."""
    # The graph shown must be this one: a newer frontend (1.49) that has just reloaded may still restore the
    # workflow open before (under an id of its own) after this one opened, so it is opened again then. The
    # frontend lays the nodes out after it has drawn them once: wait until they no longer share one spot.
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    types = sorted(node["class_type"] for node in graph.values())
    for attempt in range(3):
        page.evaluate("async ([g, n]) => { await window.app.loadApiJson(g, n); }", [graph, name])
        try:
            page.wait_for_function(SHOWN, arg=[types, API_WORKFLOW_ID], timeout=10_000)
            page.wait_for_timeout(300)  # and still shown a moment later
            if page.evaluate(SHOWN, [types, API_WORKFLOW_ID]):
                return
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    raise AssertionError(f"the page did not keep showing the workflow {name} after opening it three times")


FIT_VIEW = """() => {
    const app = window.app, canvas = app.canvas, el = canvas.canvas;
    let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
    for (const node of app.graph._nodes) {
        x0 = Math.min(x0, node.pos[0]); y0 = Math.min(y0, node.pos[1] - 30);
        x1 = Math.max(x1, node.pos[0] + node.size[0]); y1 = Math.max(y1, node.pos[1] + node.size[1]);
    }
    const scale = 0.95 * Math.min(el.width / (x1 - x0), el.height / (y1 - y0));
    canvas.ds.scale = scale;
    canvas.ds.offset = [el.width / (2 * scale) - (x0 + x1) / 2, el.height / (2 * scale) - (y0 + y1) / 2];
    canvas.setDirty(true, true);
}"""


def fit_view(page) -> None:
    """Fit the canvas on every node, as a user does after opening a workflow: each node is drawn (and so shows
    its status, which the pack draws with the node)."""
    page.evaluate(FIT_VIEW)
