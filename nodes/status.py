"""Live status on the Accel nodes in the web UI: what the engine reports (telemetry events naming the node that
applied a feature, and Compile Model's per-model state) becomes an `accel.status` message on ComfyUI's websocket
(PromptServer.send_sync, to every open page) and is kept per node for GET /accel/status, which a page reloaded
later asks for. web/accel.js draws it on the node.

One message: {"node": id, "feature": compile_model | deepcache | swap_weights | compile_vae, "state": ...,
"text": one line, "time": ...}.
"""
from __future__ import annotations

import threading
import time

from ..accel import telemetry
from ..accel.compile import status as compile_status

EVENT = "accel.status"
_lock = threading.Lock()
_latest: dict[str, dict] = {}  # node id -> its latest status message


def install() -> bool:
    """Forward the engine's events to the page; False where no ComfyUI server runs (ComfyUI as a library)."""
    try:
        from server import PromptServer
    except ImportError:
        return False
    if getattr(PromptServer, "instance", None) is None:
        return False
    telemetry.subscribe(_on_event)
    return True


def latest() -> dict[str, dict]:
    with _lock:
        return dict(_latest)


def publish(node, feature: str, state: str, text: str, **details) -> None:
    message = {"node": str(node), "feature": feature, "state": state, "text": text, "time": time.time(), **details}
    with _lock:
        previous = _latest.get(message["node"], {})
        if (previous.get("state"), previous.get("text")) == (state, text):
            return  # nothing new for the page
        _latest[message["node"]] = message
    from server import PromptServer

    PromptServer.instance.send_sync(EVENT, message)


def _on_event(event: dict) -> None:
    feature, action, node = event["feature"], event["action"], event.get("node")
    if feature == "compile_model":
        # Any change of compiled state (a run's end, a background job's end) may move every compiled model.
        for owner, status in compile_status.owner_statuses().items():
            publish(owner, "compile_model", status["state"], status["text"])
    elif node is None:
        return
    elif feature == "deepcache" and action == "run":
        skipped = event.get("compute_skipped")
        publish(node, feature, event["status"], f"reused deep features on {event['reused_steps']} of "
                f"{event['steps']} steps" + (f", about {100 * skipped:.0f}% of the compute skipped"
                                             if skipped is not None else "") + f" (run {event['status']})")
    elif feature == "swap_weights" and action == "swapped":
        publish(node, feature, "swapped", f"swapped to {event['source']} in {event['seconds']:.2f} s "
                f"({event['tensors']} tensors, {event['bytes'] / 2**20:.0f} MB)")
    elif feature == "swap_weights" and action == "in_place":
        publish(node, feature, "swapped", f"{event['source']}'s weights already in place: nothing copied")
    elif feature == "swap_weights" and action == "prepared":
        publish(node, feature, "waiting", f"{event['source']} fits the model; copied in when the model loads")
    elif feature == "swap_weights" and action == "rolled_back":
        publish(node, feature, "error", f"swap to {event['source']} stopped, original weights restored: "
                f"{event['reason']}")
    elif feature == "deepcache" and action == "applied":
        publish(node, feature, "waiting", "applied; acts at the next sampling run")
