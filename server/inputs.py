"""Turning an HTTP request into validated fields and image bytes.

Bodies are read and parsed here rather than by FastAPI's signature magic, because one
route accepts both `application/json` (base64 image or image_id) and `multipart/form-data`
(file part `image` plus a JSON part `request`), and every failure must become our error
envelope with the right status: 415 for the media type, 422 for fields, 400 for bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile

from server.errors import ServiceError

Fields = TypeVar("Fields", bound=BaseModel)

_MAX_JSON_DEPTH = 32


@dataclass
class ParsedRequest(Generic[Fields]):
    fields: Fields
    image_bytes: bytes | None  # raw file bytes (multipart)
    image_b64: str | None  # base64 text (JSON), decoded off the event loop
    image_id: str | None


def validation_message(exc: ValidationError) -> str:
    """One line per problem: `field.path: what is wrong`."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _check_depth(value: object, depth: int = 0) -> None:
    """Refuse absurd nesting before pydantic walks it (no field of ours nests deeper)."""
    if depth > _MAX_JSON_DEPTH:
        raise ServiceError(422, "invalid_request", "JSON nests too deeply")
    if isinstance(value, dict):
        for item in value.values():
            _check_depth(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_depth(item, depth + 1)


def parse_json_text(text: bytes | str) -> object:
    try:
        value = json.loads(text)
    except RecursionError:
        raise ServiceError(422, "invalid_request", "JSON nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ServiceError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    _check_depth(value)
    return value


def validate(model: type[Fields], data: object) -> Fields:
    if not isinstance(data, dict):
        raise ServiceError(422, "invalid_request", "the JSON body must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ServiceError(422, "invalid_request", validation_message(exc)) from None


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def parse_image_request(
    request: Request,
    json_model: type[BaseModel],
    fields_model: type[Fields],
    *,
    max_body_bytes: int,
) -> ParsedRequest[Fields]:
    """Read the body in either accepted form; return the fields and the image reference."""
    kind = media_type(request)
    if kind == "application/json":
        data = parse_json_text(await request.body())
        full = validate(json_model, data)
        values = full.model_dump(exclude={"image", "image_id"})
        fields = fields_model.model_validate(values)
        return ParsedRequest(
            fields, None, getattr(full, "image", None), getattr(full, "image_id", None)
        )
    if kind == "multipart/form-data":
        return await _parse_multipart(request, fields_model, max_body_bytes)
    raise ServiceError(
        415,
        "unsupported_media_type",
        f"content type {kind or '(none)'!r} is not accepted; send application/json or "
        "multipart/form-data",
    )


async def _parse_multipart(
    request: Request, fields_model: type[Fields], max_body_bytes: int
) -> ParsedRequest[Fields]:
    try:
        form = await request.form(max_files=1, max_fields=4, max_part_size=max_body_bytes)
    except ServiceError:
        raise
    except Exception as exc:  # starlette raises its own types for malformed bodies
        raise ServiceError(400, "invalid_multipart", f"malformed multipart body: {exc}") from None
    try:
        unknown = sorted(set(form.keys()) - {"image", "request"})
        if unknown:
            raise ServiceError(
                422, "invalid_request", f"unknown form parts {unknown}; expected image, request"
            )
        image = form.get("image")
        if not isinstance(image, UploadFile):
            raise ServiceError(
                422, "invalid_request", "multipart body needs a file part named 'image'"
            )
        data = await image.read()
        raw = form.get("request")
        if raw is None:
            values: object = {}
        else:
            text = await raw.read() if isinstance(raw, UploadFile) else raw
            values = parse_json_text(text)
        return ParsedRequest(validate(fields_model, values), data, None, None)
    finally:
        await form.close()
