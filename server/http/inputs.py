"""Turning an HTTP request into validated fields and image bytes.

Bodies are read and parsed here rather than by FastAPI's signature magic, because one
route accepts both `application/json` (base64 image or image_id) and `multipart/form-data`
(file part `image` plus a JSON part `request`), and every failure must become our error
envelope with the right status: 415 for the media type, 422 for fields, 400 for bytes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartParser

from server.errors import ServiceError, clip
from server.http.multipart import boundary_of, read_form
from server.http.schemas import IMAGE_ID_HEADER, is_image_id
from server.imaging import sha256_hex

Fields = TypeVar("Fields", bound=BaseModel)
T = TypeVar("T")


class InThread(Protocol):
    """Runs CPU work in the service's thread pool (`ServeState.in_thread`)."""

    def __call__(self, fn: Callable[..., T], *args: object) -> Awaitable[T]: ...


# Bodies past this are parsed in the thread pool: a 20 MB JSON body holds the GIL for
# about 18 ms in pydantic, a multipart one for a few ms in our reader and about 55 ms in
# Starlette's, and every other request (probes included) would wait behind it. Below it,
# the hop to a thread costs more than the parse (0.6 ms for 800 KB of JSON).
OFF_LOOP_BYTES = 1024 * 1024

_MAX_JSON_DEPTH = 32
# No field of ours takes more than a few hundred values (points, boxes); bodies are big
# only for their base64 string, which holds no comma. Counting commas before parsing
# bounds what json.loads, the depth walk and pydantic (one error per bad item) cost on
# the event loop: a 20 MB body of `[0,0,...]` would otherwise hold it for seconds.
_MAX_JSON_VALUES = 20_000
# No coordinate or count needs more digits (Python itself refuses past 4300: a 400).
_MAX_NUMBER_DIGITS = 400
# Shown in a 422 message; the rest are counted (one error per item of a long list).
_MAX_REPORTED_ERRORS = 10
# What a client sent, echoed in a message (a field name, a content type), is cut to this.
MAX_ECHOED = 200


@dataclass
class ParsedRequest(Generic[Fields]):
    fields: Fields
    image_bytes: bytes | None  # raw file bytes (multipart)
    image_b64: str | None  # base64 text (JSON), decoded off the event loop
    image_id: str | None
    # The X-Image-Id header sent with the bytes: `check_image_id` holds them to it.
    claimed_id: str | None = None


def image_id_header(request: Request) -> str | None:
    """The X-Image-Id header, if sent: the image_id a proxy routed this request by."""
    value = request.headers.get(IMAGE_ID_HEADER)
    if value is None:
        return None
    if not is_image_id(value):
        raise ServiceError(
            422,
            "invalid_request",
            "X-Image-Id must be 64 lowercase hex digits: the SHA-256 of the image file bytes",
        )
    return value


def mismatch(claimed: str, actual: str, what: str) -> ServiceError:
    """The 422 for an X-Image-Id that names another image than `what` does."""
    return ServiceError(
        422,
        "image_id_mismatch",
        f"X-Image-Id {claimed} is not the image_id of {what} ({actual}); send the SHA-256 "
        "of the image file bytes, or leave the header out",
    )


def check_image_id(claimed: str | None, data: bytes) -> str:
    """The image_id of `data`, which must be the one the header claimed (when it did): a
    request a proxy routed by one image must not leave another's embedding there."""
    actual = sha256_hex(data)
    if claimed is not None and claimed != actual:
        raise mismatch(claimed, actual, "the image sent")
    return actual


def validation_message(exc: ValidationError) -> str:
    """One line per problem: `field.path: what is wrong` (the first few, then a count)."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False)[:_MAX_REPORTED_ERRORS]:
        where = clip(".".join(str(p) for p in err["loc"]), MAX_ECHOED) or "body"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def _check_depth(value: object, depth: int = 0) -> None:
    """Name absurd nesting as such, rather than as pydantic's type error or recursion
    limit (no field of ours nests deeper than three)."""
    if depth > _MAX_JSON_DEPTH:
        raise ServiceError(422, "invalid_request", "JSON nests too deeply")
    if isinstance(value, dict):
        for item in value.values():
            _check_depth(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_depth(item, depth + 1)


def _parse_int(digits: str) -> int:
    if len(digits) > _MAX_NUMBER_DIGITS:
        raise ServiceError(422, "invalid_request", f"a number has {len(digits)} digits")
    return int(digits)


def _check_size(text: str) -> None:
    """Bound the work of any parse by counting commas, which costs next to nothing."""
    values = text.count(",") + 1
    if values > _MAX_JSON_VALUES:
        raise ServiceError(
            422,
            "invalid_request",
            f"the JSON holds about {values} values; no request needs over {_MAX_JSON_VALUES}",
        )


def parse_json_text(text: str) -> object:
    """Parse with the guards above; a syntax error is a 400, a shape error a 422."""
    _check_size(text)
    try:
        value = json.loads(text, parse_int=_parse_int)
    except RecursionError:
        raise ServiceError(422, "invalid_request", "JSON nests too deeply") from None
    except ValueError as exc:
        raise ServiceError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    _check_depth(value)
    return value


def validate(model: type[Fields], text: bytes | str, header_id: str | None = None) -> Fields:
    """The fields of a JSON text, validated with JSON's own types (strict): `true` is not
    a number and `"5"` not an integer, as the OpenAPI schema says, rather than coerced.

    A good body is parsed once, by pydantic (a 20 MB base64 body makes a second parse
    show). Skipping `parse_json_text` there lets nothing through that its guards would
    stop: no field nests deeper than three, or takes a number of hundreds of digits, and
    pydantic's parser has its own recursion and number limits. A refused body is parsed
    again by `parse_json_text`, as every body used to be, so that its answer stays the
    same: a syntax error a 400 in json's words, a guard or a non-object its own 422, the
    rest pydantic's 422. `header_id` (the X-Image-Id header) stands for a missing
    `image_id` field.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ServiceError(400, "invalid_json", f"body is not UTF-8: {exc}") from None
    _check_size(text)  # before pydantic, which reports one error per bad item
    try:
        context = {IMAGE_ID_HEADER: header_id} if header_id is not None else None
        return model.model_validate_json(text, strict=True, context=context)
    except ValidationError as exc:
        message = validation_message(exc)
    if not isinstance(parse_json_text(text), dict):  # the guards and the syntax, first
        raise ServiceError(422, "invalid_request", "the JSON body must be an object")
    raise ServiceError(422, "invalid_request", message)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def parse_image_request(
    request: Request,
    json_model: type[BaseModel],
    fields_model: type[Fields],
    *,
    max_body_bytes: int,
    in_thread: InThread,
) -> ParsedRequest[Fields]:
    """Read the body in either accepted form; return the fields and the image reference.

    A body over `OFF_LOOP_BYTES` is parsed by `in_thread`, off the event loop.
    """
    kind = media_type(request)
    header_id = image_id_header(request)
    if kind == "application/json":
        body = await request.body()
        if len(body) > OFF_LOOP_BYTES:
            full = await in_thread(validate, json_model, body, header_id)
        else:
            full = validate(json_model, body, header_id)
        # The JSON model is the fields model plus the image: its validation (the fields'
        # validators are inherited) holds for the fields, which need no second pass. Only
        # what the body set is passed on as set (segment everything's defaults are the
        # served model's, not the schema's).
        values = {
            name: getattr(full, name)
            for name in fields_model.model_fields
            if name in full.model_fields_set
        }
        fields = fields_model.model_construct(**values)
        image_id = getattr(full, "image_id", None)
        if header_id is not None and image_id is not None and image_id != header_id:
            raise mismatch(header_id, image_id, "the body's image_id")
        return ParsedRequest(fields, None, getattr(full, "image", None), image_id, header_id)
    if kind == "multipart/form-data":
        parsed = await _parse_multipart(request, fields_model, max_body_bytes, in_thread)
        parsed.claimed_id = header_id
        return parsed
    raise ServiceError(
        415,
        "unsupported_media_type",
        f"content type {clip(kind, MAX_ECHOED) or '(none)'!r} is not accepted; send "
        "application/json or "
        "multipart/form-data",
    )


_MAX_FILES, _MAX_FIELDS = 4, 8  # room for a duplicate or a stray part, named in a 422


async def _parse_multipart(
    request: Request, fields_model: type[Fields], max_body_bytes: int, in_thread: InThread
) -> ParsedRequest[Fields]:
    """The image part's bytes and the request part's fields.

    A plainly well-formed body (what curl, browsers and HTTP libraries send) is read by
    `server.http.multipart` in a fraction of Starlette's time; any other goes to Starlette's
    parser, which has the final word on odd or malformed bodies. Past `_MAX_FILES` files or
    `_MAX_FIELDS` fields a body is refused as malformed (400). Either reader runs in the
    thread pool for a body over `OFF_LOOP_BYTES`.
    """
    body = await request.body()  # bounded by BodyLimitMiddleware
    if len(body) > OFF_LOOP_BYTES:
        return await in_thread(_read_in_thread, body, request.headers, fields_model, max_body_bytes)
    plain = _plain_parts(body, request.headers.get("content-type", ""))
    if plain is None:
        plain = await _starlette_parts(body, request.headers, max_body_bytes)
    return _from_parts(*plain, fields_model)


def _read_in_thread(
    body: bytes, headers: Headers, fields_model: type[Fields], max_body_bytes: int
) -> ParsedRequest[Fields]:
    """`_parse_multipart`'s work for a large body, on a worker thread."""
    plain = _plain_parts(body, headers.get("content-type", ""))
    if plain is None:
        plain = asyncio.run(_starlette_parts(body, headers, max_body_bytes))
    return _from_parts(*plain, fields_model)


class _InMemoryParser(MultiPartParser):
    """Starlette's parser, keeping file parts in memory: the body already is (bounded by
    the body limit), and spooling past 1 MB would write to disk through a thread pool."""

    spool_max_size = 2**62


async def _starlette_parts(
    body: bytes, headers: Headers, max_part_size: int
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes | str]]]:
    """(files, fields) by Starlette's parser; its refusals become 400s. Uses no thread and
    no other coroutine, so a worker thread may run it under `asyncio.run`."""

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    parser = _InMemoryParser(
        headers, stream(), max_files=_MAX_FILES, max_fields=_MAX_FIELDS,
        max_part_size=max_part_size,
    )  # fmt: skip
    try:
        form = await parser.parse()
    except Exception as exc:  # starlette raises its own types for malformed bodies
        raise ServiceError(400, "invalid_multipart", f"malformed multipart body: {exc}") from None
    try:
        files: list[tuple[str, bytes]] = []
        fields: list[tuple[str, bytes | str]] = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                files.append((name, await value.read()))
            else:
                fields.append((name, value))
        return files, fields
    finally:
        await form.close()


def _plain_parts(
    body: bytes, content_type: str
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes | str]]] | None:
    """(files, fields) of a plainly well-formed body within the part limits, else None."""
    boundary = boundary_of(content_type)
    parts = None if boundary is None else read_form(body, boundary, _MAX_FILES + _MAX_FIELDS)
    if parts is None:
        return None
    files = [(p.name, p.data) for p in parts if p.filename is not None]
    try:
        fields: list[tuple[str, bytes | str]] = [
            (p.name, p.data.decode("utf-8")) for p in parts if p.filename is None
        ]
    except UnicodeDecodeError:
        return None  # Starlette words this refusal
    if len(files) > _MAX_FILES or len(fields) > _MAX_FIELDS:
        return None
    return files, fields


def _from_parts(
    files: Sequence[tuple[str, bytes]],
    fields: Sequence[tuple[str, bytes | str]],
    fields_model: type[Fields],
) -> ParsedRequest[Fields]:
    """Checks common to both readers: known, unrepeated parts; the image a file part."""
    names = [name for name, _ in [*files, *fields]]
    unknown = sorted(set(names) - {"image", "request"})
    if unknown:
        raise ServiceError(
            422,
            "invalid_request",
            f"unknown form parts {clip(str(unknown), MAX_ECHOED)}; expected image, request",
        )
    repeated = sorted(k for k in ("image", "request") if names.count(k) > 1)
    if repeated:
        raise ServiceError(
            422, "invalid_request", f"form parts {repeated} are repeated; send each once"
        )
    image = next((data for name, data in files if name == "image"), None)
    if image is None:
        raise ServiceError(
            422,
            "invalid_request",
            "multipart body needs a file part named 'image' (curl -F image=@photo.jpg)",
        )
    text = next((data for name, data in [*files, *fields] if name == "request"), "{}")
    return ParsedRequest(validate(fields_model, text), image, None, None)
