"""Live status on the Accel nodes in the web UI: what the engine reports (telemetry events naming the node that
applied a feature, and Compile Model's per-model state) becomes an `accel.status` message on ComfyUI's websocket
(PromptServer.send_sync, to every open page) and is kept per node and workflow for GET /accel/status, which a page
reloaded later asks for. web/accel.js draws it on the node.

One message: {"node": id, "workflow": the id of the workflow that ran it or None, "feature": compile_model |
deepcache | swap_weights | compile_vae, "state": ..., "text": one line, "time": ...}. The engine names who applied a
feature as nodes/common.status_owner made the name: "<workflow id>/<node id>", or the node id alone for a prompt
that names no workflow (an API prompt), whose status the page shows on any workflow.

While a kind compiles in a prompt's path, the node that waits for it also gets ComfyUI's own "progress" message
(kinds compiled so far, of all).
"""
from __future__ import annotations

import threading
import time

from ..accel import comfy_names, deepcache, telemetry
from ..accel.compile import status as compile_status

EVENT = "accel.status"
INTERRUPT_NAMES = ("comfy.model_management.processing_interrupted, InterruptProcessingException, "
                   "interrupt_current_processing")  # comfy_names.NAMES
MAX_NODES = 500  # statuses kept for GET /accel/status: a long-running server must not grow without bound
_lock = threading.Lock()
_latest: dict[str, dict] = {}  # owner ("<workflow id>/<node id>" or a node id) -> its latest message, oldest first


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


def publish(owner, feature: str, state: str, text: str, **details) -> None:
    owner = str(owner)
    workflow, _, node = owner.rpartition("/")
    message = {"node": node, "workflow": workflow or None, "feature": feature, "state": state, "text": text,
               "time": time.time(), **details}
    with _lock:
        previous = _latest.get(owner, {})
        if (previous.get("feature"), previous.get("state"), previous.get("text")) == (feature, state, text):
            previous.update(details)  # counts for /accel/status (a Compile Model node's block calls), not sent
            return  # nothing new for the page
        _latest.pop(owner, None)  # re-inserted last: the dict stays ordered oldest first
        _latest[owner] = message
        while len(_latest) > MAX_NODES:
            del _latest[next(iter(_latest))]
    from server import PromptServer

    PromptServer.instance.send_sync(EVENT, message)


def _on_event(event: dict) -> None:
    feature, action, node = event["feature"], event["action"], event.get("node")
    if feature in (compile_status.MODEL, compile_status.VAE):
        # Any change of compiled state (a run's end, a background job's end) may move every compiled model or VAE.
        statuses = compile_status.owner_statuses()
        for owner, status in statuses.items():
            publish(owner, status["feature"], status["state"], status["text"],
                    **({"calls": status["calls"]} if "calls" in status else {}))
        if action in ("compiling_now", "compiled_now"):
            _progress_of_the_waiting_node(event["kind"], statuses.values())
    elif node is None:
        return
    elif feature == "deepcache" and action == "run":
        publish(node, feature, event["status"], deepcache_run_text(event))
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
    elif feature == "deepcache" and action == "unsupported":
        publish(node, feature, "off", f"passes the model through unchanged: {event['reason']}")


def deepcache_run_text(event: dict) -> str:
    """The DeepCache node's line for a run's report (run_state.RunState.report)."""
    skipped = event.get("compute_skipped")
    text = f"reused deep features on {event['reused_steps']} of {event['steps']} steps"
    if skipped is not None:
        text += f", about {100 * skipped:.0f}% of the compute skipped"
    if event.get("preset"):  # the auto schedule: the preset of the model's kind (accel/deepcache/presets.py)
        text += f" (auto: the {event['preset']} preset, {event['schedule']} {event['threshold']:g})"
    if event.get("few_steps"):
        text += f"; {deepcache.few_steps_text(event['steps'])}"
    for reason, calls in (event.get("ran_full") or {}).items():  # what DeepCache passed through, and why
        text += f"; {calls} call(s) ran in full: {reason}"
    return text + f" (run {event['status']})"


def _progress_of_the_waiting_node(kind: str, statuses) -> None:
    """While a kind compiles in a prompt's path, the node that waits for it (the sampler, VAE Decode) shows
    ComfyUI's own progress bar: the compiled model's (or VAE's) kinds compiled so far, of all its kinds. Sent
    only from the thread that runs the prompt's node, the one ComfyUI's progress hook attributes it to; its
    own progress (the sampler's steps) takes over once the compile is done."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:  # a ComfyUI without it (docs/comfyui_compat.md): no progress on the node, nothing fails
        comfy_names.warn_missing("comfy_execution.utils.get_executing_context")
        return
    if get_executing_context() is None:
        return  # not a prompt's node (a test calling the sampler, a command-line precompile)
    progress = next((status["progress"] for status in statuses if kind in status["progress"]["kinds"]), None)
    if progress is None or not progress["total"]:
        return
    import comfy.model_management as mm
    import comfy.utils

    if comfy_names.missing(mm, ("processing_interrupted", "InterruptProcessingException",
                                "interrupt_current_processing"), INTERRUPT_NAMES):
        return
    if mm.processing_interrupted():
        return  # ComfyUI's progress hook would raise the interrupt here, and clear it
    try:
        comfy.utils.ProgressBar(progress["total"]).update_absolute(progress["done"], progress["total"])
    except mm.InterruptProcessingException:
        # The user interrupted in between, and the hook cleared the flag as it raised: set it again, so the
        # prompt's node stops at its own next check (raising here would only fail this status update).
        mm.interrupt_current_processing(True)
