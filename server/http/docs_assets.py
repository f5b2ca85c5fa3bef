"""`/docs` (Swagger UI) and `/redoc` served from files installed with the package, no CDN.

FastAPI's own pages load their JavaScript and CSS from a CDN, so in an air-gapped cluster
they stay blank. The assets come from the `fastapi-offline` package (Swagger UI 5, which
renders OpenAPI 3.1, and ReDoc's standalone bundle; MIT), mounted here with StaticFiles;
the HTML is FastAPI's own `get_swagger_ui_html` / `get_redoc_html` pointed at them.
Swagger UI's validator badge is off: it would fetch an image from validator.swagger.io.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
    swagger_ui_default_parameters,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_URL", "install_docs"]

ASSETS_URL = "/docs/assets"


def install_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Add the two documentation pages and their assets to `app` (built with
    `docs_url=None, redoc_url=None`, so FastAPI's CDN pages are not there too)."""
    directory = resources.files("fastapi_offline") / "static"
    app.mount(ASSETS_URL, StaticFiles(directory=str(directory)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    redirect_url = app.swagger_ui_oauth2_redirect_url
    parameters = {**swagger_ui_default_parameters, "validatorUrl": None}

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            oauth2_redirect_url=root + redirect_url if redirect_url else None,
            swagger_ui_parameters=parameters,
        )

    if redirect_url:

        @app.get(redirect_url, include_in_schema=False)
        async def swagger_ui_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
