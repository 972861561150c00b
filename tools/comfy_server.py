"""Start a real ComfyUI server with this pack in its custom_nodes, and talk to it over HTTP.

Used by the tests (as a fixture) and by the demo. Each server gets its own base directory (custom_nodes,
input, output, temp, user) on a free loopback port; the models come from the ComfyUI install through an
extra_model_paths file, so nothing of the ComfyUI install is written to.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from tools.comfy_env import PACK_LINK_NAME, ROOT, comfyui_dir

MODEL_FOLDERS = ("diffusion_models", "checkpoints", "loras", "clip", "text_encoders", "vae", "vae_approx")
# How often a wait asks the server (its start, a prompt's end, the pack's background work). A wait's answer comes
# up to this late while the test process's core idles, and a suite run has about 19 server starts, 70 prompts
# and dozens of background waits. A history lookup costs the server no CPU that /proc shows (50 lookups,
# 2026-11-29); /accel/stats about 5 ms each, hence its longer poll below.
POLL_S = 0.05


class ComfyServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """A ComfyUI `main.py --cpu` process. Use as a context manager so it is always stopped."""

    def __init__(self, base_dir: Path, comfy_dir: Path | None = None, extra_args: tuple[str, ...] = (),
                 with_pack: bool = True, extra_nodes: tuple[Path, ...] = (), env: dict | None = None,
                 standins: Path | None = None, api_nodes: bool = True):
        self.comfy_dir = comfy_dir or comfyui_dir()
        self.base_dir = Path(base_dir)
        self.extra_args = tuple(extra_args)
        self.with_pack = with_pack
        self.extra_nodes = tuple(Path(p) for p in extra_nodes)  # more custom-node folders (tests' own nodes)
        self.env = dict(env or {})
        # a folder of the templates' real file names (tools/template_models.py), added to the model paths
        self.standins = standins
        # False: --disable-api-nodes, ComfyUI's nodes for paid online APIs not imported (about 1-1.5 s of CPU less
        # per start on the 2-core test machine; no test uses them). Not for a server a browser opens: the flag also
        # blocks external resources in its pages.
        self.api_nodes = api_nodes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client_id = uuid.uuid4().hex
        self.log_path = self.base_dir / "comfyui.log"
        self.proc: subprocess.Popen | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def _prepare_base_dir(self) -> Path:
        for sub in ("custom_nodes", "input", "output", "temp", "user"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        link = self.base_dir / "custom_nodes" / PACK_LINK_NAME
        if self.with_pack and not link.exists():
            link.symlink_to(ROOT, target_is_directory=True)
        for folder in self.extra_nodes:
            extra_link = self.base_dir / "custom_nodes" / folder.name
            if not extra_link.exists():
                extra_link.symlink_to(folder.resolve(), target_is_directory=True)
        models = self.comfy_dir / "models"
        lines = []
        for section, base in (("accel_generated_models", models), ("accel_template_standins", self.standins)):
            if base is not None:
                lines += [f"{section}:", f"  base_path: {base}", *(f"  {folder}: {folder}" for folder in MODEL_FOLDERS)]
        extra = self.base_dir / "extra_model_paths.yaml"
        extra.write_text("\n".join(lines) + "\n")
        return extra

    def start(self, timeout: float = 180.0) -> "ComfyServer":
        extra = self._prepare_base_dir()
        cmd = [sys.executable, str(self.comfy_dir / "main.py"), "--cpu", "--listen", "127.0.0.1",
               "--port", str(self.port), "--disable-auto-launch", "--dont-print-server",
               "--base-directory", str(self.base_dir), "--extra-model-paths-config", str(extra),
               *(() if self.api_nodes else ("--disable-api-nodes",)), *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.comfy_dir, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComfyServerError(f"ComfyUI exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                self.get_json("/system_stats", timeout=2)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(POLL_S)
        self.stop()
        raise ComfyServerError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        if getattr(self, "_log_file", None):
            self._log_file.close()

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    # -- HTTP ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body=None, timeout: float = 30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def get_json(self, path: str, timeout: float = 30):
        return self._request("GET", path, timeout=timeout)

    def post_json(self, path: str, body, timeout: float = 30):
        return self._request("POST", path, body, timeout=timeout)

    def queue_prompt(self, graph: dict) -> str:
        try:
            answer = self.post_json("/prompt", {"prompt": graph, "client_id": self.client_id})
        except urllib.error.HTTPError as err:
            raise ComfyServerError(f"ComfyUI refused the workflow: {err.read().decode(errors='replace')}") from err
        return answer["prompt_id"]

    def wait_for(self, prompt_id: str, timeout: float = 600.0) -> dict:
        """Poll /history until the prompt finished; return its history entry or raise with ComfyUI's error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
            status = (entry or {}).get("status", {})
            if status.get("completed"):
                return entry
            if status.get("status_str") == "error":
                raise ComfyServerError(f"prompt {prompt_id} failed: {json.dumps(status.get('messages'))[-4000:]}")
            if self.proc is not None and self.proc.poll() is not None:
                raise ComfyServerError(f"ComfyUI died while running the prompt:\n{self.log_tail()}")
            time.sleep(POLL_S)
        raise ComfyServerError(f"prompt {prompt_id} did not finish in {timeout:.0f} s:\n{self.log_tail()}")

    def run_workflow(self, graph: dict, timeout: float = 600.0) -> dict:
        return self.wait_for(self.queue_prompt(graph), timeout=timeout)

    def wait_for_background(self, timeout: float = 900) -> dict:
        """The pack's background-compile stats once nothing runs, is queued or is held for an idle moment (its
        children, inductor's CPU checks, graphs still to load); AssertionError with the last stats on timeout."""
        deadline = time.monotonic() + timeout
        while (background := self.get_json("/accel/stats")["compile"]["background"])["busy"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"the pack's background work did not end in {timeout:.0f} s: {background}")
            time.sleep(4 * POLL_S)
        return background

    def output_images(self, entry: dict) -> list[Path]:
        paths = []
        for node_output in entry.get("outputs", {}).values():
            for image in node_output.get("images", []):
                if image.get("type") == "output":
                    paths.append(self.base_dir / "output" / image.get("subfolder", "") / image["filename"])
        return paths


def load_workflow(name: str) -> dict:
    """One of the project's own API-format workflows on its generated models (tools/workflows/: the demo's, the
    tests'); the templates' API copies for users are in workflows_api/ (tools/make_templates.py)."""
    return json.loads((ROOT / "tools" / "workflows" / name).read_text())
