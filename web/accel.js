// ComfyUI-Accel browser extension: tags the pack's nodes and draws each one's live status under it (compiling in
// the background, compiled with the measured speedup, eager and why, DeepCache's reused steps, Swap Weights' copy).
// The server sends `accel.status` messages over ComfyUI's websocket (nodes/status.py); a page opened or reloaded
// later asks GET /accel/status for the latest ones. ComfyUI may serve this folder twice (from WEB_DIRECTORY and
// from pyproject's [tool.comfy].web under another name), so registration is guarded.
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
const statuses = new Map(); // node (execution) id -> the latest status message of that node
const MAX_LINES = 4; // of a status under its node (GET /accel/status has the whole text)

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
// Node ids repeat between workflows and subgraphs, so a message counts only if its id leads to this very node and
// its feature is this node's type.
// Copies of one subgraph share its nodes: the latest status of any copy is shown, not the first one sent.
function statusOf(node) {
  const id = String(node.id);
  const candidates = [statuses.get(id), ...[...statuses.values()].filter((m) => String(m.node).endsWith(`:${id}`))];
  return candidates.filter((m) => m && NODE_OF_FEATURE[m.feature] === node.type && nodeAt(m.node) === node)
    .reduce((latest, m) => (!latest || m.time > latest.time ? m : latest), undefined);
}

function showStatus(message) {
  statuses.set(String(message.node), message);
  app.canvas?.setDirty(true, true); // drawn (and node.accelStatus set) by onDrawForeground
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

function drawStatus(ctx, node, status) {
  const pad = 6, lineHeight = 14, width = node.size[0];
  ctx.save();
  ctx.font = "12px sans-serif";
  const lines = wrapText(ctx, status.text, width - 2 * pad - 12);
  const top = node.size[1] + 6, height = lines.length * lineHeight + 2 * pad;
  ctx.fillStyle = "rgba(20, 20, 20, 0.85)";
  ctx.beginPath();
  ctx.roundRect ? ctx.roundRect(0, top, width, height, 6) : ctx.rect(0, top, width, height);
  ctx.fill();
  ctx.fillStyle = STATE_COLORS[status.state] ?? "#9aa0a6";
  ctx.beginPath();
  ctx.arc(pad + 4, top + pad + lineHeight / 2, 4, 0, 2 * Math.PI);
  ctx.fill();
  ctx.fillStyle = "#e8eaed";
  ctx.textBaseline = "middle";
  lines.forEach((text, i) => ctx.fillText(text, pad + 14, top + pad + lineHeight * (i + 0.5)));
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
        return result;
      };
      const onDrawForeground = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function (ctx) {
        const result = onDrawForeground?.apply(this, arguments);
        const status = statusOf(this);
        this.accelStatus = status;
        if (status && !this.flags?.collapsed) drawStatus(ctx, this, status);
        return result;
      };
    },
  });
}
