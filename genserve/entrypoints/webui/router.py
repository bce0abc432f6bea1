"""Routes of the web UI: `/` serves `genserve/webui/index.html`; its assets live under `/ui/`
(no API route starts with it). Only the files listed in `UI_ASSETS` are served, so no path
can reach outside the folder.

The UI is served whatever runs behind the gateway: on a server without a diffusion model the
page finds no diffusion model in /v1/models and opens on its chat panel alone."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from genserve.entrypoints.errors import not_found

WEBUI_DIR = Path(__file__).resolve().parents[2] / "webui"
UI_ASSETS = {
    "styles.css": "text/css; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "decoder_worker.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "gallery.js": "text/javascript; charset=utf-8",
}
# The UI is small and changes with the server version: always revalidate.
_NO_CACHE = {"Cache-Control": "no-cache"}


def build_router() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(
            WEBUI_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_NO_CACHE
        )

    @router.get("/ui/{name}", include_in_schema=False)
    async def ui_asset(name: str) -> FileResponse:
        media_type = UI_ASSETS.get(name)
        if media_type is None:
            raise not_found(f"No web UI file named {name!r}.")
        return FileResponse(WEBUI_DIR / name, media_type=media_type, headers=_NO_CACHE)

    return router
