"""HTTP routes on ComfyUI's server (also mirrored by ComfyUI under /api/...)."""
from __future__ import annotations

import asyncio

from ..accel import __version__, telemetry
from . import status


def register_routes() -> bool:
    """Add GET /accel/stats, GET /accel/status (the latest status of each Accel node, for a page opened or
    reloaded after it was sent: status.py), GET /accel/cache (the disk cache) and POST /accel/cache/clear (the
    web UI's panel) when a ComfyUI server exists (not when ComfyUI is a library)."""
    try:
        from aiohttp import web
        from server import PromptServer
    except ImportError:
        return False
    if getattr(PromptServer, "instance", None) is None:
        return False

    @PromptServer.instance.routes.get("/accel/stats")
    async def accel_stats(request):
        from ..accel.compile import REGISTRY
        from ..accel.diagnostics import thread_report
        from ..accel.malloc.report import settings
        from ..accel.malloc.step_faults import STEP_FAULTS

        # "threads" off the event loop: reads of /proc, and a 50 ms second look when a pool of the pack's seems
        # to be there (diagnostics.PROC_SETTLE_SECONDS), which would stall every other request meanwhile. torch's
        # thread count reads the same there: ATen gives each thread the process's count on the thread's first use.
        threads = await asyncio.get_running_loop().run_in_executor(None, thread_report)
        # "malloc": glibc's live settings and the last sampling's minor page faults per step (docs/process_tax.md)
        return web.json_response({"version": __version__, **telemetry.snapshot(), "compile": REGISTRY.stats(),
                                  "threads": threads,
                                  "malloc": {**settings(), "last_sampling_faults": STEP_FAULTS.last()}})

    @PromptServer.instance.routes.get("/accel/status")
    async def accel_status(request):
        return web.json_response(status.latest())

    @PromptServer.instance.routes.get("/accel/cache")
    async def accel_cache(request):
        from ..accel.compile.cache_control import cache_on_disk

        # off the event loop: sizing a large cache walks every file
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, cache_on_disk))

    @PromptServer.instance.routes.post("/accel/cache/clear")
    async def accel_cache_clear(request):
        """Takes nothing from the request: it clears this server's cache root and nothing else."""
        from ..accel.cache import CacheBusy
        from ..accel.compile.cache_control import clear_cache

        try:  # off the event loop: removing a large cache takes a while, and the server keeps serving meanwhile
            return web.json_response(await asyncio.get_running_loop().run_in_executor(None, clear_cache))
        except CacheBusy as busy:
            return web.json_response({"error": str(busy)}, status=409)

    status.install()
    return True
