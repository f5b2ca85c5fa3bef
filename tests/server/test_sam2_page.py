"""The page at `/` on a SAM 2.1 server, in a real browser (tests/server/test_page.py's
Chromium and tab fixtures): the model list names it, a click draws exactly the mask the
server sent, a refining click sends the handle back, and "Segment everything" is answered
(SAM 2's generator) with no error on the page."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect

from tests.server import test_page as page_tests
from tests.server.conftest import LiveServer, small_settings
from tests.server.test_page import DOG, answer_of, covered, decode, record_calls, screen_point

browser = page_tests.browser  # the module's Chromium
page = page_tests.page  # a fresh tab; an error in the page's scripts fails the test


@pytest.fixture(scope="module")
def sam2_server() -> Iterator[LiveServer]:
    live = LiveServer(small_settings(sam_model="sam2_test_tiny")).start()
    yield live
    live.stop()


def test_the_page_segments_with_sam2_and_segments_everything(
    page: Page, sam2_server: LiveServer
) -> None:
    calls = record_calls(page)
    page.goto(sam2_server.url + "/")
    expect(page.locator("#models li")).to_have_count(2)
    expect(page.locator("#models")).to_contain_text("sam2_test_tiny")
    expect(page.locator("#random-warning")).to_contain_text("sam2_test_tiny")
    page.set_input_files("#file-input", DOG)
    expect(page.locator("#labels li")).to_have_count(5)

    first = answer_of(page, "/v1/segment", lambda: page.mouse.click(*screen_point(page, 400, 260)))
    assert first["model"]["name"] == "sam2_test_tiny"
    best = first["results"][0]["masks"][0]
    assert (covered(page) == decode(best["segmentation"])).all()
    second = answer_of(page, "/v1/segment", lambda: page.mouse.click(*screen_point(page, 600, 120)))
    sent = [r.post_data_json for r in calls if r.url.endswith("/v1/segment")]
    assert sent[1]["mask_input"] == best["low_res_handle"]
    assert (covered(page) == decode(second["results"][0]["masks"][0]["segmentation"])).all()
    expect(page.locator("#errors")).to_be_hidden()

    with page.expect_response(lambda r: r.url.endswith("/v1/segment/everything")) as answer:
        page.click("#everything")
    assert answer.value.status == 200
    assert answer.value.json()["model"]["name"] == "sam2_test_tiny"
    expect(page.locator("#status")).not_to_contain_text("Segmenting everything")
    expect(page.locator("#errors")).to_be_hidden()
