"""What the browser tests do to ComfyUI's page (Debian's Chromium driven by Playwright, tools/browser.py): dialogs
shown, screenshots kept, a prompt queued from the page and waited for."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def error_dialogs(page) -> list[str]:
    """Dialogs, and warning or error toasts (the frontend's alert for a workflow it cannot read is one)."""
    shown = page.query_selector_all(".p-dialog, .p-toast-message-warn, .p-toast-message-error")
    return [d.inner_text()[:500] for d in shown if d.is_visible()]


def screenshot(page, name: str) -> None:
    """ACCEL_SCREENSHOT_DIR=docs/ui keeps a screenshot of each state the tests reach (the README shows them)."""
    directory = os.environ.get("ACCEL_SCREENSHOT_DIR")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(directory) / f"{name}.png"))


def queue_and_wait(page, server, timeout: float = 300) -> None:
    """Queue the page's workflow as the Queue button does, and wait for it to succeed."""
    before = len(server.get_json("/history"))
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = server.get_json("/history")
        if len(history) > before:
            entry = list(history.values())[-1]
            assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-3000:]
            return
        time.sleep(0.1)
    raise AssertionError(f"the queued prompt did not finish in {timeout:.0f} s:\n{server.log_tail()}")


def page_prompt(page) -> dict:
    """The page's workflow as the API prompt the Queue button would send (the frontend's own graphToPrompt)."""
    return page.evaluate("async () => (await window.app.graphToPrompt()).output")
