"""`validate` parses a good JSON body once, and a refused one gets the answer it always got.

The API tests check statuses and codes through a server; these check the messages too,
where only `parse_json_text`'s second look at a refused body can give them (pydantic
alone would name a deep list a type error, or a 5000-deep one invalid JSON, a 400).
"""

from __future__ import annotations

import json

import pytest

from server.errors import ServiceError
from server.http import inputs
from server.http.inputs import validate
from server.http.schemas import SegmentJSON

BOX = '"image": "aGk=", "box": [0, 0, 5, 5]'


def nested(depth: int) -> str:
    """A good body but for an extra field nested `depth` lists deep."""
    return "{" + BOX + ', "x": ' + "[" * depth + "]" * depth + "}"


def test_a_good_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def second_parse(*args: object, **kwargs: object) -> object:
        raise AssertionError("a good body was parsed twice")

    monkeypatch.setattr(inputs.json, "loads", second_parse)
    body = json.dumps({"image": "aGk=" * 1000, "point_coords": [[1, 2]], "point_labels": [1]})
    assert validate(SegmentJSON, body.encode()).point_labels == [1]


@pytest.mark.parametrize(
    ("body", "status", "code", "message"),
    [
        (nested(40), 422, "invalid_request", "nests too deeply"),
        (nested(5000), 422, "invalid_request", "nests too deeply"),
        ('{"image": "x", "point_coords": [[' + "9" * 5000 + ', 1]], "point_labels": [1]}',
         422, "invalid_request", "a number has 5000 digits"),
        ("[" + "0," * 20_000 + "0]", 422, "invalid_request", "values"),
        ("[]", 422, "invalid_request", "must be an object"),
        ('{"image": ', 400, "invalid_json", "body is not valid JSON"),
        ("{" + BOX + "} x", 400, "invalid_json", "body is not valid JSON"),
        # json takes a lone surrogate, pydantic does not: a 422 as before, not a 400
        ('{"image": "\\ud800", "box": [0, 0, 5, 5]}', 422, "invalid_request", "hex escape"),
        ('{"image": "x", "point_coords": [[1, 2]], "point_labels": [true]}',
         422, "invalid_request", "point_labels.0"),
    ],
    ids=[
        "40 deep", "5000 deep", "5000 digits", "too many values", "not an object", "cut",
        "trailing text", "lone surrogate", "label true",
    ],
)  # fmt: skip
def test_a_refused_body_keeps_its_answer(body: str, status: int, code: str, message: str) -> None:
    with pytest.raises(ServiceError) as refused:
        validate(SegmentJSON, body)
    assert (refused.value.status, refused.value.code) == (status, code)
    assert message in refused.value.message
