// ComfyUI-Accel browser extension: tags the pack's nodes and draws each one's live status under it (compiling in
// the background, compiled with the measured speedup, eager and why, DeepCache's reused steps, Swap Weights' copy).
// The server sends `accel.status` messages over ComfyUI's websocket (nodes/status.py); a page opened or reloaded
// later asks GET /accel/status for the latest ones. ComfyUI may serve this folder twice (from WEB_DIRECTORY and
// from pyproject's [tool.comfy].web under another name), so registration is guarded.
//
// Two renderers: the classic canvas draws each node's foreground, where the status goes, under the node. "Nodes
// 2.0" (the frontend's Vue renderer, setting Comfy.VueNodes.Enabled) draws no foreground, so there the status is
// the last widget of each Accel node, given to the node when it is created (the Vue renderer shows the widgets a
// node has when the renderer takes it, so switching renderers works both ways): the frontend draws a widget type
// it does not know through its own fallback (a canvas of the widget's own) with the same drawing. That widget is
// never saved with the workflow nor sent in a prompt: a value in the prompt would change the node's inputs, and
// ComfyUI would run the node again. On the classic canvas it takes no room and draws nothing.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXTENSION = "comfyui-accel.nodes";
const ACCEL_NODES = new Set(["AccelCompileModel", "AccelCompileVAE", "AccelDeepCache", "AccelSwapWeights"]);
const STATUS_EVENT = "accel.status";
const STATE_COLORS = {
  waiting: "#9aa0a6", compiling: "#f0b429", loading: "#f0b429", checking: "#f0b429", compiled: "#3ecf8e", eager: "#8ab4f8",
  completed: "#3ecf8e", swapped: "#3ecf8e", interrupted: "#f28b82", error: "#f28b82", off: "#9aa0a6",
};
const NODE_OF_FEATURE = {
  compile_model: "AccelCompileModel", deepcache: "AccelDeepCache", swap_weights: "AccelSwapWeights",
  compile_vae: "AccelCompileVAE",
};
const statuses = new Map(); // "<workflow id>/<node (execution) id>" -> the latest status message of that node
const MAX_LINES = 4; // of a status under its node (GET /accel/status has the whole text)
const PAD = 6, LINE_HEIGHT = 14, FONT = "12px sans-serif";
const STATUS_WIDGET = "accel_status"; // the status's widget under Nodes 2.0 (its name and type)

// LiteGraph is a global of the page (older frontends) or under comfyAPI (newer)
const vueNodes = () => Boolean((globalThis.LiteGraph ?? globalThis.comfyAPI?.litegraph?.LiteGraph)?.vueNodesMode);

// A node inside a subgraph runs under an execution id made of the ids of the subgraph nodes around it and its own,
// joined by ":" ("12:3"): walk down from the root graph to find it.
function nodeAt(executionId) {
  let graph = app.rootGraph ?? app.graph;
  let node;
  for (const id of String(executionId).split(":")) {
    node = graph?.getNodeById(id);
    if (!node) return undefined;
    graph = node.subgraph;
  }
  return node;
}

// The status sent for this node: under its own id at the root, under an id ending in ":<its id>" in a subgraph.
// Node ids repeat between workflows and subgraphs (each template numbers its Compile Model 2), so a message counts
// only if it came from the workflow open now (its prompt carried that workflow's id; a prompt sent over the API,
// or from a workflow without an id of its own, names none and counts on any: nodes/common.py), its id leads to
// this very node and its feature is this node's type.
// Copies of one subgraph share its nodes: the latest status of any copy is shown, not the first one sent.
function statusOf(node) {
  const id = String(node.id);
  const workflow = (app.rootGraph ?? app.graph)?.id;
  return [...statuses.values()].filter((m) => (m.workflow == null || m.workflow === workflow)
      && (String(m.node) === id || String(m.node).endsWith(`:${id}`))
      && NODE_OF_FEATURE[m.feature] === node.type && nodeAt(m.node) === node)
    .reduce((latest, m) => (!latest || m.time > latest.time ? m : latest), undefined);
}

function showStatus(message) {
  statuses.set(`${message.workflow ?? ""}/${message.node}`, message);
  app.canvas?.setDirty(true, true); // drawn (and node.accelStatus set) by onDrawForeground, or:
  if (vueNodes()) showStatusWidgets();
}

// Nodes 2.0: the status widget of each node with a status draws again (`triggerDraw` is set by the frontend's
// fallback while the widget is on screen; one mounted later draws then). Newer frontends size the widget by the
// height the canvas's layout last gave it, so it draws once more after the canvas's next frame has laid it out
// for the new text.
function showStatusWidgets() {
  for (const message of statuses.values()) {
    const node = nodeAt(message.node);
    if (!node || NODE_OF_FEATURE[message.feature] !== node.type) continue;
    const widget = statusWidget(node);
    widget?.triggerDraw?.();
    requestAnimationFrame(() => requestAnimationFrame(() => widget?.triggerDraw?.()));
  }
}

function statusWidget(node) {
  return node.widgets?.find((w) => w.name === STATUS_WIDGET);
}

function addStatusWidget(node) {
  node.addCustomWidget({
    name: STATUS_WIDGET, type: STATUS_WIDGET, value: "", serialize: false, options: { serialize: false },
    // the canvas's layout asks without a width: the node's
    computeSize: (width = node.size[0]) => (vueNodes() ? [width, statusHeight(statusOf(node), width)] : [0, -4]),
    draw(ctx, drawn, width, y) {
      if (!vueNodes()) return; // [0, -4] above: no room, nothing drawn on the classic canvas
      const status = statusOf(drawn);
      drawn.accelStatus = status;
      if (status) drawStatus(ctx, status, y, width);
    },
  });
}

let measuring; // a canvas context that only measures text, for a widget's height before it is drawn
function statusHeight(status, width) {
  if (!status) return 0;
  measuring ??= document.createElement("canvas").getContext("2d");
  measuring.font = FONT;
  return statusLines(measuring, status, width).length * LINE_HEIGHT + 2 * PAD;
}

function statusLines(ctx, status, width) {
  return wrapText(ctx, status.text, width - 2 * PAD - 12);
}

function wrapText(ctx, text, width) {
  const lines = [];
  let line = "";
  for (const word of text.split(" ")) {
    const candidate = line ? `${line} ${word}` : word;
    if (line && ctx.measureText(candidate).width > width) {
      lines.push(line);
      line = word;
    } else {
      line = candidate;
    }
  }
  if (line) lines.push(line);
  if (lines.length <= MAX_LINES) return lines;
  // the longest texts (a rolled-back swap, an eager verdict's reason) say most at the end: mark the cut
  let last = lines[MAX_LINES - 1];
  while (last && ctx.measureText(`${last}…`).width > width) last = last.slice(0, -1);
  return [...lines.slice(0, MAX_LINES - 1), `${last}…`];
}

// The status as a box `width` wide from `top` down: under the node on the classic canvas, in its widget else.
function drawStatus(ctx, status, top, width) {
  ctx.save();
  ctx.font = FONT;
  const lines = statusLines(ctx, status, width);
  const height = lines.length * LINE_HEIGHT + 2 * PAD;
  ctx.fillStyle = "rgba(20, 20, 20, 0.85)";
  ctx.beginPath();
  ctx.roundRect ? ctx.roundRect(0, top, width, height, 6) : ctx.rect(0, top, width, height);
  ctx.fill();
  ctx.fillStyle = STATE_COLORS[status.state] ?? "#9aa0a6";
  ctx.beginPath();
  ctx.arc(PAD + 4, top + PAD + LINE_HEIGHT / 2, 4, 0, 2 * Math.PI);
  ctx.fill();
  ctx.fillStyle = "#e8eaed";
  ctx.textBaseline = "middle";
  lines.forEach((text, i) => ctx.fillText(text, PAD + 14, top + PAD + LINE_HEIGHT * (i + 0.5)));
  ctx.restore();
}

if (!app.extensions?.some((ext) => ext.name === EXTENSION)) {
  app.registerExtension({
    name: EXTENSION,
    async setup() {
      api.addEventListener(STATUS_EVENT, ({ detail }) => showStatus(detail));
      try {
        const response = await api.fetchApi("/accel/status");
        if (response.ok) Object.values(await response.json()).forEach(showStatus);
      } catch (error) {
        console.warn("[Accel] could not read /accel/status:", error);
      }
    },
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (!ACCEL_NODES.has(nodeData.name)) return;
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        this.color = "#2a4d3e";
        this.bgcolor = "#1f3a2f";
        addStatusWidget(this); // after the node's own widgets: their saved values keep their places
        return result;
      };
      const onDrawForeground = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function (ctx) {
        const result = onDrawForeground?.apply(this, arguments);
        const status = statusOf(this);
        this.accelStatus = status;
        if (status && !this.flags?.collapsed) drawStatus(ctx, status, this.size[1] + 6, this.size[0]);
        return result;
      };
    },
  });
}
