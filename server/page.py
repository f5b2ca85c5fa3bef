"""The browser page at `/`: try the service by hand, from the app itself.

Served by the app (not a CDN, no build step), so the page is same-origin with the API and
works while CORS stays closed. Files come from the package's `server/static` folder through
`importlib.resources`, so an installed wheel serves them as an editable checkout does.

Caching: every file carries a strong `ETag` (SHA-256 of its bytes) and `Cache-Control:
no-cache`, so browsers keep a copy but revalidate each load; a 304 costs a few bytes, and a
new release is never hidden behind a stale script. File names are checked against a plain
pattern and a fixed list of types before anything is opened, so no path can climb out of
the folder.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.errors import ServiceError

__all__ = ["router"]

router = APIRouter(include_in_schema=False)

# One flat folder: a name is letters, digits, '_', '-' and dots, never starting with a dot.
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}$")
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


@dataclass(frozen=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str


@cache
def _asset(name: str) -> _Asset | None:
    """Read a file of `server/static` once per process; None when there is no such file.

    Cached because the folder is part of the installed package and does not change while
    the process runs; misses are cached too, and there are few possible names anyway.
    """
    suffix = name[name.rfind(".") :] if "." in name else ""
    media_type = _TYPES.get(suffix)
    if media_type is None or not _NAME.fullmatch(name) or ".." in name:
        return None
    entry = resources.files("server").joinpath("static").joinpath(name)
    if not entry.is_file():
        return None
    body = entry.read_bytes()
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    return _Asset(body, media_type, etag)


def _serve(request: Request, name: str) -> Response:
    """The file with its type and validators; 304 when the browser's copy is current."""
    asset = _asset(name)
    if asset is None:
        raise ServiceError(404, "not_found", f"no such file: /static/{name}")
    headers = {**_HEADERS, "ETag": asset.etag}
    if asset.etag in {t.strip() for t in request.headers.get("if-none-match", "").split(",")}:
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else asset.body
    headers["Content-Length"] = str(len(asset.body))
    return Response(body, media_type=asset.media_type, headers=headers)


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request) -> Response:
    """The page itself."""
    return _serve(request, "index.html")


@router.api_route("/favicon.ico", methods=["GET", "HEAD"])
async def favicon(request: Request) -> Response:
    """Browsers ask for it unprompted; an SVG answers rather than a 404 in the log."""
    return _serve(request, "favicon.svg")


@router.api_route("/static/{name:path}", methods=["GET", "HEAD"])
async def static(request: Request, name: str) -> Response:
    """Scripts, styles and icons of the page (one flat folder; see `_NAME`)."""
    return _serve(request, name)
