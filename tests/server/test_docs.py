"""`/docs` and `/redoc` work with no network: every asset comes from the server itself.

Checked twice on a real server: over HTTP (the pages name no other host, and each script
and stylesheet they name is served), and in a real Chromium whose every request to another
origin is refused and recorded, where Swagger UI must render the service's operations.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect

from server.http.docs_assets import ASSETS_URL
from tests.server.conftest import LiveServer
from tests.server.test_page import browser  # noqa: F401 (the module's Chromium fixture)

_REFERENCE = re.compile(r"""(?:src|href|url)\s*[=:(]\s*['"]([^'"]+)['"]""")


def references(html: str) -> list[str]:
    """Every URL the page's HTML and inline script name (src=, href=, url: '...')."""
    return _REFERENCE.findall(html)


@pytest.fixture
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "assets"),
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"}),
        ("/redoc", {"redoc.standalone.js", "favicon.png"}),
    ],
)
def test_docs_pages_name_only_local_assets_and_they_are_served(
    http: httpx.Client, path: str, assets: set[str]
) -> None:
    page = http.get(path)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    urls = references(page.text)
    assert {u.rsplit("/", 1)[-1] for u in urls if u.startswith(ASSETS_URL)} == assets
    assert "/openapi.json" in urls
    assert not [u for u in urls if urlsplit(u).netloc], f"another host named: {urls}"
    assert "fonts.googleapis" not in page.text
    if path == "/docs":  # Swagger UI's validator badge would be an image from its site
        assert '"validatorUrl": null' in page.text
    types = {".js": "javascript", ".css": "text/css", ".png": "image/png"}
    for name in assets:
        asset = http.get(f"{ASSETS_URL}/{name}")
        assert asset.status_code == 200, name
        assert len(asset.content) > 1000, name
        assert types[name[name.rindex(".") :]] in asset.headers["content-type"], name


def test_assets_route_refuses_what_is_not_there(http: httpx.Client) -> None:
    for path in ("/nope.js", "/../app.py", "/%2e%2e/app.py"):
        assert http.get(ASSETS_URL + path).status_code == 404, path


def test_swagger_ui_renders_the_operations_with_the_network_closed(
    live_server: LiveServer,
    browser: Browser,  # noqa: F811
) -> None:
    origin = live_server.url
    refused: list[str] = []

    def only_this_server(route: Route) -> None:
        url = route.request.url
        if url.startswith((origin + "/", "data:")):
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    context = browser.new_context()
    try:
        page = context.new_page()
        page.route("**/*", only_this_server)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(origin + "/docs")
        operations = page.locator(".opblock-summary-path")
        expect(operations.first).to_be_visible(timeout=30_000)
        shown = set(operations.all_inner_texts())
        for path in ("/v1/segment", "/v1/segment/everything", "/v1/embed", "/v1/classify"):
            assert any(path == text.strip().replace("\u200b", "") for text in shown), shown
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("SAM + Swin")
        assert not errors, errors
        assert not refused, f"the page reached for another host: {refused}"
    finally:
        context.close()
