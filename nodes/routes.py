"""HTTP routes on ComfyUI's server (also mirrored by ComfyUI under /api/...)."""
from __future__ import annotations

from ..accel import __version__, telemetry


def register_routes() -> bool:
    """Add GET /accel/stats when a ComfyUI server exists (not when ComfyUI is imported as a library)."""
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

        return web.json_response({"version": __version__, **telemetry.snapshot(), "compile": REGISTRY.stats()})

    return True
