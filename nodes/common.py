"""What every Accel node shares: its menu category, its logger, and how it names itself in the web UI's statuses."""
from __future__ import annotations

import logging

CATEGORY = "Accel"
log = logging.getLogger("comfyui_accel")

# The hidden inputs a node needs to name itself in the statuses (status_owner).
OWNER_INPUTS = {"unique_id": "UNIQUE_ID", "extra_pnginfo": "EXTRA_PNGINFO"}
# The id of a workflow that has none of its own: the frontend gives it to a dropped API file (and the templates
# had it). Frontend 1.49 gives such a workflow a new random id when a reload restores it, so its statuses are
# named as a prompt's that names no workflow: they show on any workflow, as they did after the reload.
NO_WORKFLOW_ID = "00000000-0000-0000-0000-000000000000"


def status_owner(unique_id, extra_pnginfo) -> str | None:
    """The name under which the engine reports what this node applied: "<workflow id>/<node id>", or the node id
    alone where the prompt names no workflow (an API prompt, or NO_WORKFLOW_ID; the frontend sends its workflow,
    id included, in extra_pnginfo). Node ids repeat between workflows (each template numbers its Compile Model
    2), so the page shows a status only on the workflow that ran it (nodes/status.py splits the name again).
    Node ids never hold a "/"; a subgraph's inner node is "12:3"."""
    if unique_id is None:
        return None
    workflow = extra_pnginfo.get("workflow") if isinstance(extra_pnginfo, dict) else None
    workflow_id = workflow.get("id") if isinstance(workflow, dict) else None
    if isinstance(workflow_id, str) and workflow_id and workflow_id != NO_WORKFLOW_ID:
        return f"{workflow_id}/{unique_id}"
    return str(unique_id)
