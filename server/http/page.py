"""The browser page at `/`: try the service by hand, from the app itself.

Served by the app (not a CDN, no build step), so the page is same-origin with the API and
works while CORS stays closed. Files come from the package's `server/http/static` folder through
`importlib.resources`, so an installed wheel serves them as an editable checkout does.

- Safety: the folder is listed once and only names from that listing are served, so no
  path (`..`, encoded slashes, absolute paths) can reach anything else.
- Caching: a strong `ETag` (SHA-256 of the bytes) and `Cache-Control: no-cache`: browsers
  keep a copy but revalidate each load (a 304 costs a few bytes), so a new release is never
  hidden behind a stale script, and no build step has to version file names.
- The page's own `Content-Security-Policy` allows only this origin (no inline script, no
  framing), so the API key typed into it stays with this origin.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import PurePosixPath

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.errors import ServiceError

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def _assets() -> dict[str, _Asset]:
    """Every servable file of `server/http/static` by name, read once per process.

    The folder ships inside the package and does not change while the process runs; it
    is small (tens of kB). Hidden files and unknown types are left out.
    """
    folder = resources.files("server.http").joinpath("static")
    assets: dict[str, _Asset] = {}
    for entry in folder.iterdir():
        media_type = _TYPES.get(PurePosixPath(entry.name).suffix)
        if media_type is None or entry.name.startswith(".") or not entry.is_file():
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[entry.name] = _Asset(body, media_type, etag)
    return assets


def _serve(request: Request, name: str, extra: dict[str, str] | None = None) -> Response:
    """The file with its type and validators; 304 when the browser's copy is current."""
    asset = _assets().get(name)
    if asset is None:
        raise ServiceError(404, "not_found", f"no such file: /static/{name}")
    headers = {**_HEADERS, **(extra or {}), "ETag": asset.etag}
    if asset.etag in {t.strip() for t in request.headers.get("if-none-match", "").split(",")}:
        return Response(status_code=304, headers=headers)
    headers["Content-Length"] = str(len(asset.body))
    body = b"" if request.method == "HEAD" else asset.body
    return Response(body, media_type=asset.media_type, headers=headers)


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request) -> Response:
    """The page itself."""
    return _serve(request, "index.html", _PAGE_HEADERS)


@router.api_route("/favicon.ico", methods=["GET", "HEAD"])
async def favicon(request: Request) -> Response:
    """Browsers ask for it unprompted; the SVG icon answers rather than a 404 in the log."""
    return _serve(request, "favicon.svg")


@router.api_route("/static/{name:path}", methods=["GET", "HEAD"])
async def static(request: Request, name: str) -> Response:
    """Scripts, styles and icons of the page (one flat folder)."""
    return _serve(request, name)
