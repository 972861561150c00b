"""The web UI in a real browser: Debian's Chromium, driven by Playwright, on a started ComfyUI server with its own
frontend and this pack in custom_nodes. The Accel nodes show the status the server sends over the websocket, also
after a reload, inside a subgraph and under the frontend's Nodes 2.0 renderer; a node that waits for a compile in
its prompt's path shows ComfyUI's own progress; the panel lists and clears. (The templates, their model links and
the node docs: test_templates.py.)
The workflows here are the project's own on its generated models (tools/workflows/), opened as a dropped API file.

ACCEL_SCREENSHOT_DIR=docs/ui keeps a screenshot of each state (the README shows them). CI runs these against
ComfyUI 0.3.75's frontend (1.32) and 0.33.0's (1.49): `make test COMFYUI=0.33.0` sets that one up; one file alone:
`ACCEL_COMFYUI=0.33.0 .venv-0.33.0/bin/pytest -n 0 tests/test_web_ui.py`.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tools.browser import comfy_page, fit_view, load_api_workflow
from tools.comfy_env import ROOT
from tools.comfy_server import ComfyServer, load_workflow
from ui_pages import page_prompt, queue_and_wait, screenshot

pytestmark = pytest.mark.server
SETTLED = ("compiled", "eager")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """One server and one page for the module: (server, page). The server has a compile cache of its own: the
    panel test clears it."""
    base = tmp_path_factory.mktemp("web-ui")
    with ComfyServer(base, env={"ACCEL_CACHE_DIR": str(base / "accel-cache")}) as server, comfy_page(server) as page:
        listen(page)
        yield server, page
        pack_errors = [entry for entry in page.accel_log if _from_the_pack(entry)]
        assert not pack_errors, f"errors from the pack's files or routes in the page: {pack_errors}"


def listen(page) -> None:
    """Keep what the page receives (again after each reload, which forgets it)."""
    page.evaluate("""() => {
        window.accelSeen = [];  // the pack's status messages
        window.accelEvents = [];  // those and ComfyUI's progress messages, in the order they came
        const api = window.comfyAPI.api.api;
        api.addEventListener("accel.status", ({detail}) => {
            window.accelSeen.push(detail);
            window.accelEvents.push({type: "accel.status", detail});
        });
        api.addEventListener("progress", ({detail}) => window.accelEvents.push({type: "progress", detail}));
    }""")


def _from_the_pack(entry: tuple[str, str]) -> bool:
    kind, text = entry
    if kind in ("requestfailed", "http"):
        return "comfyui-accel" in text or "/accel/" in text
    return kind in ("error", "pageerror") and ("accel" in text.lower())


# The image size of the workflows opened here: the in-process tests' (compile_helpers.sample: a 16x16 latent, cond
# and uncond batched), so that some of the C++ kernels this server's children build for the small SD1.5 UNet and
# TAESD are ones test_compile_model.py built, which the compiler cache then holds even on a fresh machine. Measured
# 2026-11-26 on the 2-core test CPU, the two files alone on an empty compiler cache, one run each: 68 kernel builds
# here instead of 84 at the workflow's own 256x256, and 335 s instead of 355 s for both files. Nothing these tests
# check depends on the size.
SIZE = 128


def open_workflow(page, name: str) -> dict:
    """Open one of the project's workflows (tools/workflows/<name>_api.json) as a dropped API file, at SIZE;
    returns the graph's node types by id (the API file's ids)."""
    graph = load_workflow(f"{name}_api.json")
    for node in graph.values():
        if node["class_type"] == "EmptyLatentImage":
            node["inputs"].update(width=SIZE, height=SIZE)
    load_api_workflow(page, graph, name)
    fit_view(page)
    return page.evaluate("() => Object.fromEntries(window.app.graph._nodes.map(n => [String(n.id), n.type]))")


def node_id(nodes: dict, node_type: str) -> str:
    return next(i for i, t in nodes.items() if t == node_type)


def status_of(page, node: str) -> dict | None:
    return page.evaluate("(id) => window.app.graph.getNodeById(Number(id))?.accelStatus ?? null", node)


def wait_status(page, node: str, states: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = status_of(page, node)
        if status and status["state"] in states:
            return status
        time.sleep(0.1)
    raise AssertionError(f"node {node} never showed {states}: last {status_of(page, node)}")


def test_nodes_show_status_from_the_server_and_after_a_reload(ui):
    server, page = ui
    nodes = open_workflow(page, "accel_txt2img")
    compile_node, deepcache_node = node_id(nodes, "AccelCompileModel"), node_id(nodes, "AccelDeepCache")
    vae_node = node_id(nodes, "AccelCompileVAE")
    assert status_of(page, vae_node) is None  # nothing ran yet
    queue_and_wait(page, server)
    deepcache = wait_status(page, deepcache_node, ("completed",), timeout=30)
    assert "reused deep features on 4 of 6 steps" in deepcache["text"], deepcache  # interval 3
    # the server's cache is empty: the kinds compile in the background child, for a minute or more on this CPU
    first = wait_status(page, compile_node, ("compiling",), timeout=30)
    screenshot(page, "status_compiling")
    refused = page.request.post(f"{server.url}/accel/cache/clear")  # the panel's button, refused meanwhile
    assert refused.status == 409 and "background compile" in refused.json()["error"], refused.text()
    assert Path(server.get_json("/accel/cache")["root"]).is_dir()
    # The background compile ends between prompts; a few more prompts time compiled against eager. Samples taken
    # while the pack's own work runs (the VAE's child, inductor's CPU checks) are dropped, so each
    # prompt waits for that work first, as the demo does.
    for _ in range(4):
        status = status_of(page, compile_node)
        if status["state"] in SETTLED:
            break
        if status["state"] in ("compiling", "loading"):  # the server's next message moves it, no prompt needed
            status = wait_status(page, compile_node, ("checking",) + SETTLED, timeout=400)
        if status["state"] not in SETTLED:
            server.wait_for_background(timeout=400)
            queue_and_wait(page, server)
    status = wait_status(page, compile_node, SETTLED, timeout=60)
    if status["state"] == "compiled":
        assert "kinds compiled" in status["text"], status
    else:
        assert status["text"].startswith("eager: "), status
    seen = page.evaluate("() => window.accelSeen")
    seen_states = [m["state"] for m in seen if m["node"] == compile_node]
    assert first["state"] in seen_states and status["state"] in seen_states, seen_states
    # Compile VAE: its cold decode went to the background child; the VAE's own calls time compiled against eager
    vae = wait_status(page, vae_node, ("loading", "checking") + SETTLED, timeout=400)
    assert vae["feature"] == "compile_vae" and vae["text"].startswith("decode "), vae
    assert "compiling" in [m["state"] for m in page.evaluate("() => window.accelSeen") if m["node"] == vae_node]
    screenshot(page, "status_settled")

    # A reload: the page asks GET /accel/status and shows the same statuses on the same workflow.
    page.reload()
    page.wait_for_function("window.app && window.app.graph && window.app.canvas", timeout=90_000)
    listen(page)
    open_workflow(page, "accel_txt2img")
    page.wait_for_function("(id) => window.app.graph.getNodeById(Number(id))?.accelStatus", arg=compile_node,
                           timeout=30_000)
    assert status_of(page, compile_node)["text"] == status["text"]
    assert status_of(page, deepcache_node)["text"] == deepcache["text"]
    assert status_of(page, vae_node)["feature"] == "compile_vae"


def set_widget(page, node: str, name: str, value) -> None:
    page.evaluate("""([id, name, value]) => {
        const widget = window.app.graph.getNodeById(Number(id)).widgets.find((w) => w.name === name);
        if (!widget) throw new Error(`node ${id} has no widget ${name}`);
        widget.value = value;
    }""", [node, name, value])


def bypass(page, node: str) -> None:
    """Bypass a node as its menu does (mode 4): the frontend passes its input through."""
    page.evaluate("(id) => { window.app.graph.getNodeById(Number(id)).mode = 4; }", node)


@pytest.mark.full(why=(
    "the progress of a compile in the prompt's path, in the browser; make test shows the statuses in "
    "test_nodes_show_status_from_the_server_and_after_a_reload"))
def test_the_waiting_node_shows_comfyuis_progress_while_a_kind_compiles_in_its_path(ui):
    """Compile Model with the background compile off compiles in the prompt's path: the sampler, which waits for
    it, gets ComfyUI's own progress message (kinds compiled so far, of all) while the Accel node says why."""
    server, page = ui
    nodes = open_workflow(page, "accel_txt2img")
    compile_node, sampler = node_id(nodes, "AccelCompileModel"), node_id(nodes, "KSampler")
    set_widget(page, compile_node, "choose", "always compiled")
    set_widget(page, compile_node, "background", False)
    # a compile key no earlier prompt made graphs for (the defaults' child saved dynamic graphs of "auto" that
    # serve any size), at a new shape: compiled in this prompt
    set_widget(page, compile_node, "dynamic", "static")
    set_widget(page, node_id(nodes, "EmptyLatentImage"), "width", 192)
    # Compile VAE bypassed (the frontend passes its VAE through): at the new size its decode would be a new shape,
    # a background job of 37 kernel builds (105 s here) that this test does not look at and the next tests wait on.
    bypass(page, node_id(nodes, "AccelCompileVAE"))
    page.evaluate("() => { window.accelEvents = []; }")
    queue_and_wait(page, server)
    events = page.evaluate("() => window.accelEvents")
    waits = [i for i, e in enumerate(events) if e["type"] == "accel.status" and e["detail"]["node"] == compile_node
             and "in the prompt's path" in e["detail"]["text"]]
    assert waits, (events[:40], server.log_tail())
    kinds = int(re.search(r"(\d+) of (\d+) kinds compiled so far", events[waits[0]]["detail"]["text"]).group(2))
    progress = [e["detail"] for e in events[waits[0]:] if e["type"] == "progress" and e["detail"]["node"] == sampler]
    assert progress and progress[0]["max"] == kinds and progress[0]["value"] < kinds, (kinds, progress[:5])
    steps = [p for p in progress if p["max"] == 6]  # the sampler's own steps take over after the compile
    assert steps and steps[-1]["value"] == 6, progress
    final = status_of(page, compile_node)
    assert final["state"] != "compiling", final  # the compile's end was sent too


def test_a_node_inside_a_subgraph_shows_its_status(ui):
    """Nodes in a subgraph run under ids like "12:3"; their status shows on the node inside the subgraph."""
    server, page = ui
    nodes = open_workflow(page, "accel_txt2img")
    outer, inner = page.evaluate("""(id) => {
        const graph = window.app.graph;
        const {node, subgraph} = graph.convertToSubgraph(new Set([graph.getNodeById(Number(id))]));
        return [String(node.id), String(subgraph.nodes[0].id)];
    }""", node_id(nodes, "AccelDeepCache"))
    queue_and_wait(page, server)
    deadline = time.monotonic() + 30
    while not any(m["node"] == f"{outer}:{inner}" for m in page.evaluate("() => window.accelSeen")):
        assert time.monotonic() < deadline, "no status message for the node in the subgraph"
        time.sleep(0.1)
    page.evaluate("""(id) => {
        const outer = window.app.graph.getNodeById(Number(id));
        window.app.canvas.openSubgraph(outer.subgraph, outer);
    }""", outer)
    status = page.wait_for_function("""([outer, inner]) => window.app.graph.getNodeById(Number(outer)).subgraph
        .getNodeById(Number(inner))?.accelStatus""", arg=[outer, inner], timeout=30_000).json_value()
    assert status["node"] == f"{outer}:{inner}" and "reused deep features" in status["text"], status
    screenshot(page, "status_in_subgraph")
    page.evaluate("() => window.app.canvas.setGraph(window.app.graph)")


def with_workflow_id(page, workflow_id: str) -> None:
    """Open the page's graph again as the workflow of that id, as the frontend opens a saved file of that id."""
    page.evaluate("""async (id) => {
        const workflow = window.app.graph.serialize();
        workflow.id = id;
        await window.app.loadGraphData(workflow);
    }""", workflow_id)
    fit_view(page)


def drawn_status(page, node: str) -> dict | None:
    """The status the node shows once it has been drawn (onDrawForeground sets accelStatus, if only to undefined)."""
    page.wait_for_function("(id) => Object.hasOwn(window.app.graph.getNodeById(Number(id)), 'accelStatus')",
                           arg=node, timeout=10_000)
    return status_of(page, node)


def test_a_status_shows_only_on_the_workflow_that_ran_it(ui):
    """Node ids repeat between workflows (each template numbers its Compile Model 2): a status shows on the
    workflow whose prompt made it (the frontend sends the workflow's id with the prompt), not on another
    workflow's node of the same id and type. A status from a prompt that names no workflow (one sent over the
    API, or one of a dropped API file, which has the zero id: the other tests here) shows on any."""
    server, page = ui
    nodes = open_workflow(page, "accel_txt2img")
    node = node_id(nodes, "AccelDeepCache")
    for node_type in ("AccelCompileModel", "AccelCompileVAE"):  # nothing to compile: the statuses are checked
        bypass(page, node_id(nodes, node_type))
    # An end_percent of its own, so that the node runs in this prompt: ComfyUI would reuse its output from an
    # earlier test's prompt, which named another workflow.
    set_widget(page, node, "end_percent", 0.95)
    ran, other = "5b0e7a52-8c1f-4d3e-9a6b-2f4c8d1e7a90", "c3d9e1f0-7b2a-4e5c-8d6f-1a2b3c4d5e6f"
    with_workflow_id(page, ran)
    queue_and_wait(page, server)
    status = wait_status(page, node, ("completed",), timeout=60)
    assert status["workflow"] == ran and "reused deep features" in status["text"], status
    assert server.get_json("/accel/status")[f"{ran}/{node}"]["text"] == status["text"]

    with_workflow_id(page, other)  # the same nodes under another workflow's id: the status is not its own
    shown = drawn_status(page, node)  # (an earlier test's, from a workflow without an id, may show)
    assert shown is None or shown["workflow"] is None, shown
    with_workflow_id(page, ran)
    assert drawn_status(page, node)["text"] == status["text"]

    with_workflow_id(page, other)
    page.evaluate("""(id) => window.comfyAPI.api.api.dispatchCustomEvent("accel.status", {node: id, workflow: null,
        feature: "deepcache", state: "waiting", text: "named no workflow", time: Date.now() / 1000})""", node)
    page.wait_for_function("(id) => window.app.graph.getNodeById(Number(id)).accelStatus?.text === 'named no "
                           "workflow'", arg=node, timeout=10_000)


def test_a_status_longer_than_four_lines_ends_in_an_ellipsis(ui):
    """A status of more than four lines under its node (a rolled-back swap's reason, an eager verdict's) is cut at
    the fourth, which now ends in "…" (before, it stopped mid-sentence with no sign of more). The message is one
    the server sends, dispatched in the page as its websocket would; what the node draws is read from the
    canvas's own fillText calls."""
    _, page = ui
    nodes = open_workflow(page, "accel_txt2img")
    node = node_id(nodes, "AccelDeepCache")
    drawn = page.evaluate("""async (id) => {
        const text = "passes the model through unchanged: " + "a reason that goes on and on ".repeat(20) + "END";
        const fillText = CanvasRenderingContext2D.prototype.fillText;
        const lines = [];
        CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) {
            // the status's lines (widgets draw short words of it too: "model", "mode")
            if (typeof t === "string" && t.length > 12 && text.includes(t.replace(/…$/, ""))) lines.push(t);
            return fillText.call(this, t, ...rest);
        };
        try {
            window.comfyAPI.api.api.dispatchCustomEvent("accel.status",
                {node: id, feature: "deepcache", state: "off", text, time: Date.now() / 1000});
            window.app.canvas.setDirty(true, true);
            for (let i = 0; i < 50 && !lines.length; i++) await new Promise((r) => setTimeout(r, 100));
        } finally {
            CanvasRenderingContext2D.prototype.fillText = fillText;
        }
        return lines;
    }""", node)
    first_draw = drawn[:4]
    assert len(first_draw) == 4 and first_draw[-1].endswith("…") and "END" not in "".join(first_draw), drawn


def test_swap_weights_shows_the_copy(ui):
    server, page = ui
    # Node ids repeat between workflows: the status of another workflow's node of the same id and another type
    # must not show. Put a Swap Weights node under the id of an earlier workflow's Accel node of another type.
    taken = another_workflows_node(server, page)
    swap_node = node_id(open_workflow(page, "accel_swap_weights"), "AccelSwapWeights")
    page.evaluate("""(id) => {
        const graph = window.app.graph;
        const old = graph.getNodeById(Number(id));
        if (old) graph.remove(old);
        const node = (window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).createNode("AccelSwapWeights");
        node.id = Number(id);
        node.pos = [40, 40];
        graph.add(node);
        window.app.canvas.setDirty(true, true);
    }""", taken)
    drawn = page.wait_for_function("""(id) => {  // drawn: onDrawForeground set accelStatus, if only to undefined
        const node = window.app.graph.getNodeById(Number(id));
        return Object.hasOwn(node, "accelStatus") && node.type;
    }""", arg=taken, timeout=10_000).json_value()
    assert drawn == "AccelSwapWeights" and status_of(page, taken) is None, (drawn, status_of(page, taken))
    open_workflow(page, "accel_swap_weights")
    queue_and_wait(page, server)
    status = wait_status(page, swap_node, ("swapped",), timeout=60)
    assert "accel-sd15-small-b.safetensors" in status["text"], status
    screenshot(page, "status_swap_weights")


def test_panel_lists_the_compiled_kinds_and_clears_the_disk_cache(ui):
    server, page = ui
    server.wait_for_background(timeout=300)  # the swap's run may have left background work: clear waits for none
    compiled_kinds_on_disk(server, page)
    root = Path(server.get_json("/accel/cache")["root"])
    assert root.is_dir() and server.get_json("/accel/cache")["environments"], "the compiles left no cache"
    page.click(".accel-tab-button")
    page.wait_for_selector(".accel-panel", timeout=30_000)
    panel = page.inner_text(".accel-panel")
    kinds = [k["kind"] for k in server.get_json("/accel/stats")["compile"]["kinds"]]
    assert kinds and all(kind in panel for kind in kinds), (kinds, panel[:2000])
    assert str(root) in panel and "Disk cache" in panel
    screenshot(page, "panel")
    page.once("dialog", lambda dialog: dialog.accept())  # the button asks first
    page.click(".accel-clear-cache")
    page.wait_for_function("() => document.querySelector('.accel-message')?.textContent.startsWith('Removed')",
                           timeout=30_000)
    assert not root.exists(), f"{root} still on disk after the panel cleared it"
    assert server.get_json("/accel/cache")["environments"] == []
    page.click(".accel-tab-button")  # closes the panel


# Each test stands alone (`pytest tests/test_web_ui.py::name`): what a test needs from an earlier prompt on the
# module's server, it runs itself when the tests before it did not (in the file's order they did, at no cost).

def another_workflows_node(server, page) -> str:
    """The id of a node of the txt2img workflow with an Accel status other than Swap Weights' (not one inside a
    subgraph, whose id is "outer:inner"); runs that workflow with its compile nodes bypassed (its DeepCache
    reports, nothing compiles) when no earlier prompt left one."""
    def found() -> str | None:
        return next((m["node"] for m in server.get_json("/accel/status").values()
                     if m["feature"] != "swap_weights" and ":" not in m["node"]), None)

    if found() is None:
        nodes = open_workflow(page, "accel_txt2img")
        for node_type in ("AccelCompileModel", "AccelCompileVAE"):
            bypass(page, node_id(nodes, node_type))
        queue_and_wait(page, server)
    return found()


def compiled_kinds_on_disk(server, page) -> None:
    """Compiled kinds in the server's stats and in its disk cache; compiles the txt2img workflow's UNet in the
    prompt's path (Compile VAE bypassed) when no earlier prompt left them."""
    if server.get_json("/accel/stats")["compile"]["kinds"] and server.get_json("/accel/cache")["environments"]:
        return
    nodes = open_workflow(page, "accel_txt2img")
    compile_node = node_id(nodes, "AccelCompileModel")
    set_widget(page, compile_node, "choose", "always compiled")
    set_widget(page, compile_node, "background", False)
    bypass(page, node_id(nodes, "AccelCompileVAE"))
    queue_and_wait(page, server, timeout=600)


PACK_ROUTES = {"/accel/stats": "GET", "/accel/status": "GET", "/accel/cache": "GET", "/accel/cache/clear": "POST"}


def test_every_pack_route_answers_malformed_requests_without_a_server_error(ui, tmp_path):
    """Wrong methods, query strings and bodies that name paths, bodies that are not JSON, a megabyte of noise: each
    pack route (and ComfyUI's /api/ mirror of it) answers below 500, and none acts on a path it was given."""
    server, page = ui
    registered = re.findall(r'routes\.(get|post)\("([^"]+)"\)', (ROOT / "nodes" / "routes.py").read_text())
    assert {route: method.upper() for method, route in registered} == PACK_ROUTES, "a route this test misses"
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "keep").write_text("not the cache")
    root = server.get_json("/accel/cache")["root"]
    bodies = (None, "{not json", json.dumps({"path": str(decoy), "root": str(decoy), "environment": "../.."}),
              "\xff" * (1 << 20))
    for route, method in PACK_ROUTES.items():
        for url in (f"{server.url}{route}", f"{server.url}/api{route}"):
            wrong = page.request.fetch(url, method="POST" if method == "GET" else "GET")
            assert 400 <= wrong.status < 500, (url, wrong.status, wrong.text()[:300])
            for query in ("", f"?path={decoy}", "?root=..%2F..%2F&node=%00&x=" + "y" * 4000):
                for body in bodies:
                    answer = page.request.fetch(url + query, method=method, data=body,
                                                headers={"Content-Type": "application/json"})
                    assert answer.status < 500, (url + query[:80], str(body)[:40], answer.status, answer.text()[:300])
                    if answer.ok:
                        assert isinstance(answer.json(), dict)
                        if route == "/accel/cache/clear":
                            assert answer.json()["root"] == root, answer.json()
    assert (decoy / "keep").read_text() == "not the cache", "a route acted on a path it was given"


def test_nodes_2_0_shows_each_status_in_a_widget_never_saved_nor_sent(ui):
    """Under the frontend's Vue renderer ("Nodes 2.0", setting Comfy.VueNodes.Enabled), which draws no node's
    foreground, an Accel node's status is a widget at the bottom of the node, drawn by the frontend's fallback for
    a widget type it does not know. The widget is not saved with the workflow (its other widgets' values are, as
    many as before) nor sent in the prompt (a value there would change the node's inputs, and ComfyUI would run
    it again). Back on the classic canvas, the status is drawn under the node again."""
    server, page = ui

    def renderer(vue: bool) -> None:
        server.post_json("/settings/Comfy.VueNodes.Enabled", vue)
        page.reload()
        page.wait_for_function("(vue) => window.app && window.app.graph && window.app.canvas && "
                               "(window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).vueNodesMode === vue",
                               arg=vue, timeout=90_000)
        listen(page)

    renderer(True)
    try:
        nodes = open_workflow(page, "accel_txt2img")
        deepcache_node = node_id(nodes, "AccelDeepCache")
        for node_type in ("AccelCompileModel", "AccelCompileVAE"):  # nothing to compile: the widget is checked
            bypass(page, node_id(nodes, node_type))
        queue_and_wait(page, server)
        # node.accelStatus is set by the widget's draw: the widget is on screen and drew this status
        status = wait_status(page, deepcache_node, ("completed",), timeout=60)
        assert "reused deep features" in status["text"], status
        node = page.evaluate("""(id) => {
            const node = window.app.graph.getNodeById(Number(id));
            const canvas = document.querySelector(`[data-node-id="${id}"] canvas`);
            const pixels = canvas?.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data ?? [];
            // the frontend's fallback draws at twice the size, 2 px taller than the height it gave the widget
            const drawnHeight = canvas ? canvas.height / 2 - 2 : 0;
            return {widgets: node.widgets.map((w) => w.name), saved: node.serialize().widgets_values.length,
                    painted: pixels.filter((value, i) => i % 4 === 3 && value > 0).length, drawnHeight,
                    needed: canvas ? node.widgets.at(-1).computeSize(canvas.width / 2)[1] : null};
        }""", deepcache_node)
        assert node["widgets"][-1] == "accel_status" and node["saved"] == len(node["widgets"]) - 1, node
        assert node["painted"] > 500, f"the status widget's canvas is blank: {node}"
        assert node["drawnHeight"] >= node["needed"] > 0, f"the status is cut: {node}"  # every line of it
        assert "accel_status" not in page_prompt(page)[deepcache_node]["inputs"]
        screenshot(page, "status_nodes_2")
    finally:
        renderer(False)
    open_workflow(page, "accel_txt2img")
    page.wait_for_function("(id) => window.app.graph.getNodeById(Number(id))?.accelStatus", arg=deepcache_node,
                           timeout=30_000)  # drawn under the node by the classic canvas
    assert status_of(page, deepcache_node)["text"] == status["text"]
