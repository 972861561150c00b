// ComfyUI-Accel browser extension: tags the pack's nodes so users see which nodes accelerate the graph.
// ComfyUI may serve this folder twice (from WEB_DIRECTORY and from pyproject's [tool.comfy].web under
// another name), so registration is guarded.
import { app } from "../../scripts/app.js";

const EXTENSION = "comfyui-accel.nodes";
const ACCEL_NODES = new Set(["AccelCompileModel", "AccelCompileVAE", "AccelDeepCache", "AccelSwapWeights"]);

if (!app.extensions?.some((ext) => ext.name === EXTENSION)) {
  app.registerExtension({
    name: EXTENSION,
    async beforeRegisterNodeDef(nodeType, nodeData) {
      if (!ACCEL_NODES.has(nodeData.name)) return;
      const onNodeCreated = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = onNodeCreated?.apply(this, arguments);
        this.color = "#2a4d3e";
        this.bgcolor = "#1f3a2f";
        return result;
      };
    },
  });
}
