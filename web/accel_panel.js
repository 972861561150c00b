// ComfyUI-Accel panel: a sidebar tab (the frontend's registerSidebarTab; a menu command opening a dialog where the
// frontend has no sidebar API) with the compiled kinds and their paths and reasons, recompiles with the guard that
// failed, background jobs, the disk cache (location, size per environment) and a button that clears it
// (POST /accel/cache/clear: no path in the request; the server refuses while anything compiles).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXTENSION = "comfyui-accel.panel";
const TAB_ID = "accel";

function element(tag, text, style) {
  const el = document.createElement(tag);
  if (text !== undefined) el.textContent = text;
  if (style) el.style.cssText = style;
  return el;
}

function table(headers, rows) {
  const t = element("table", undefined, "width:100%;border-collapse:collapse;font-size:12px;margin-bottom:8px");
  const head = t.insertRow();
  headers.forEach((h) => head.appendChild(element("th", h, "text-align:left;padding:2px 4px;opacity:.7")));
  rows.forEach((row) => {
    const r = t.insertRow();
    row.forEach((cell) => r.appendChild(element("td", String(cell ?? ""), "padding:2px 4px;vertical-align:top")));
  });
  return t;
}

async function readJson(path) {
  const response = await api.fetchApi(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function render(root) {
  root.replaceChildren(element("div", "Loading…"));
  let stats, cache;
  try {
    [stats, cache] = await Promise.all([readJson("/accel/stats"), readJson("/accel/cache")]);
  } catch (error) {
    root.replaceChildren(element("div", `Could not read the pack's state: ${error.message}`));
    return;
  }
  const compile = stats.compile;
  const parts = [element("h3", `ComfyUI-Accel ${stats.version}`, "margin:4px 0 8px")];
  const buttons = element("div", undefined, "display:flex;gap:6px;margin-bottom:8px");
  const refresh = element("button", "Refresh");
  refresh.className = "p-button p-button-sm p-button-secondary accel-refresh";
  refresh.onclick = () => render(root);
  const clear = element("button", "Clear disk cache");
  clear.className = "p-button p-button-sm p-button-danger accel-clear-cache";
  const message = element("div", "", "font-size:12px;margin-bottom:8px");
  message.className = "accel-message";
  clear.onclick = async () => {
    // Every compiled graph of every environment goes: the next prompts compile again (minutes on a CPU).
    if (!window.confirm("Clear the compile cache? Compiled graphs are made again at the next prompts.")) return;
    let text;
    try {
      const response = await api.fetchApi("/accel/cache/clear", { method: "POST" });
      const answer = await response.json();
      text = response.ok ? `Removed ${answer.root} (${answer.removed_megabytes} MB).` : `Not cleared: ${answer.error}`;
    } catch (error) {  // no JSON answer: a proxy's error page, a server gone
      text = `Not cleared: ${error.message}`;
    }
    await render(root);
    const shown = root.querySelector(".accel-message");
    if (shown) shown.textContent = text;
  };
  buttons.append(refresh, clear);
  parts.push(buttons, message);

  parts.push(element("h4", "Compiled block kinds", "margin:8px 0 4px"));
  // A list rather than a table: the reasons are sentences and the sidebar is narrow.
  compile.kinds.forEach((k) => {
    const item = element("div", undefined, "font-size:12px;margin-bottom:6px");
    item.append(element("div", `${k.kind}: ${k.path}, ${k.compiles} compiles`, "font-weight:600"));
    const why = k.reason || k.background?.reason;
    if (why) item.append(element("div", why, "opacity:.75"));
    parts.push(item);
  });
  if (!compile.kinds.length) parts.push(element("div", "none yet", "font-size:12px"));
  const recompiles = compile.kinds.filter((k) => k.recompiles > 0);
  parts.push(element("h4", "Recompiles", "margin:8px 0 4px"));
  recompiles.forEach((k) => parts.push(element("div",
    `${k.kind}: ${k.recompiles}; guard that failed: ${(k.recompile_reasons || []).slice(-1)[0] || "?"}`,
    "font-size:12px;margin-bottom:6px")));
  if (!recompiles.length) parts.push(element("div", "none", "font-size:12px"));
  const background = compile.background;
  parts.push(element("h4", "Background compiles", "margin:8px 0 4px"));
  parts.push(table(["running", "queued", "held for an idle moment", "finished"], [[
    background.running ? `${background.running.kinds.join(", ")} (${background.running.seconds} s)` : "none",
    background.queued.join(", ") || "none", background.held_until_idle.join(", ") || "none",
    background.finished.length]]));
  parts.push(element("h4", "Disk cache", "margin:8px 0 4px"));
  parts.push(element("div", cache.root, "font-size:12px;word-break:break-all;margin-bottom:4px"));
  parts.push(cache.environments.length
    ? table(["environment", "compile keys", "MB"], cache.environments.map((e) => [e.env_id, e.keys, e.megabytes]))
    : element("div", "empty", "font-size:12px"));
  const panel = element("div", undefined, "padding:8px;overflow:auto;height:100%");
  panel.className = "accel-panel";
  panel.append(...parts);
  root.replaceChildren(panel);
}

if (!app.extensions?.some((ext) => ext.name === EXTENSION)) {
  app.registerExtension({
    name: EXTENSION,
    async setup() {
      const manager = app.extensionManager;
      if (manager?.registerSidebarTab) {
        manager.registerSidebarTab({
          id: TAB_ID, icon: "pi pi-bolt", title: "Accel", tooltip: "ComfyUI-Accel: compiled kinds and the cache",
          type: "custom", render: (el) => render(el),
        });
        return;
      }
      // Frontends without the sidebar API: a floating dialog from a menu command.
      manager?.registerCommand?.({ id: "Accel.OpenPanel", label: "ComfyUI-Accel panel", function: () => {
        const dialog = element("div", undefined,
          "position:fixed;right:16px;top:64px;width:420px;max-height:80vh;background:#222;color:#ddd;" +
          "border:1px solid #444;border-radius:6px;z-index:1000;overflow:auto");
        const close = element("button", "×", "float:right");
        close.onclick = () => dialog.remove();
        const body = element("div");
        dialog.append(close, body);
        document.body.appendChild(dialog);
        render(body);
      } });
    },
  });
}
