"""A strict `multipart/form-data` reader for whole, well-formed bodies.

Starlette's parser (python-multipart, then a spooled temporary file per upload, on disk
past 1 MB) runs on the event loop's thread holding the GIL: 0.48 ms for a 644 KB photo and
10.9 ms for a 4 MB upload on the 2-core CPU. This one finds the boundaries with
`bytes.find` and copies each part once: 0.16 and 0.68 ms (`python -m bench.host_costs`).
It accepts only what browsers, curl and HTTP libraries send: CRLF line ends, a
`Content-Disposition: form-data` header with a `name` in every part. Anything else
returns None, and the caller hands the body to Starlette's parser, which keeps the final
word on odd or malformed bodies and their error messages.

Part headers are capped (`MAX_PART_HEADER_BYTES`, 400 beyond): a 9 MB `filename` of
escapes or a 16 MB unclosed quoted parameter once held the event loop for seconds in the
parameter regex and `re.sub` (both linear, but slow per character). Starlette's fallback
has python-multipart's own caps (4 KB a header line, 8 headers a part).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from server.errors import ServiceError

__all__ = ["MAX_PART_HEADER_BYTES", "FormPart", "boundary_of", "read_form"]

# A part's header block (Content-Disposition, Content-Type): about 100 bytes from curl or a
# browser, a few hundred with a long UTF-8 file name.
MAX_PART_HEADER_BYTES = 4096

# RFC 2046 bchars; 1 to 70 of them, not ending in a space
_BOUNDARY = re.compile(rb"^[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]$")
# a header parameter: name=token or name="quoted string" (backslash escapes, as curl writes)
_PARAM = re.compile(r';\s*([A-Za-z0-9_.*-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*+)"|([^;\s"]*))')
_ESCAPE = re.compile(r"\\(.)")


def _params(text: str) -> list[tuple[str, str]] | None:
    """(name, value) of each `; name=value` in `text`, or None unless all of it parses.

    Matched at each position in turn rather than searched for, so that text between the
    parameters (an unclosed quote, junk) declines the body instead of being skipped.
    """
    found: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _PARAM.match(text, pos)
        if match is None:
            return None if text[pos:].strip() else found
        quoted = match.group(2)
        value = _ESCAPE.sub(r"\1", quoted) if quoted is not None else match.group(3)
        found.append((match.group(1), value))
        pos = match.end()
    return found


@dataclass(frozen=True)
class FormPart:
    name: str
    filename: str | None  # None: a plain field; a string (maybe empty): a file
    data: bytes


def boundary_of(content_type: str) -> bytes | None:
    """The boundary parameter of a `multipart/form-data` content type, or None."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    for name, value in _params(";" + params) or ():
        if name.lower() == "boundary":
            raw = value.encode("latin-1", "replace")
            return raw if _BOUNDARY.fullmatch(raw) else None
    return None


def _disposition(headers: bytes) -> tuple[str, str | None] | None:
    """(name, filename) from a part's headers, or None unless they are plain form-data."""
    try:
        text = headers.decode("utf-8")
    except UnicodeDecodeError:
        return None
    found: tuple[str, str | None] | None = None
    for line in text.split("\r\n"):
        key, colon, value = line.partition(":")
        if not colon or not key or key != key.strip():
            return None  # folded or malformed header lines: not for this reader
        if key.lower() != "content-disposition":
            continue
        if found is not None:
            return None
        kind, _, params = value.strip().partition(";")
        if kind.strip().lower() != "form-data":
            return None
        values: dict[str, str] = {}
        params_found = _params(";" + params)
        if params_found is None:
            return None  # not plainly `; name=value` throughout: Starlette words it
        for key_name, value in params_found:
            key_name = key_name.lower()
            if key_name in values or key_name.endswith("*"):
                return None  # repeated or RFC 5987 parameters: leave them to Starlette
            values[key_name] = value
        if "name" not in values:
            return None
        found = (values["name"], values.get("filename"))
    return found


def read_form(body: bytes, boundary: bytes, max_parts: int) -> list[FormPart] | None:
    """The parts of a whole body, in order; None when it is not plainly well formed
    (including more than `max_parts` parts). Raises a 400 `ServiceError` for a part whose
    headers run past `MAX_PART_HEADER_BYTES`."""
    delimiter = b"--" + boundary
    if not body.startswith(delimiter):
        return None  # a preamble, or not multipart at all
    view = memoryview(body)
    parts: list[FormPart] = []
    pos = len(delimiter)
    while True:
        if body.startswith(b"--", pos):  # the closing delimiter; the epilogue is ignored
            return parts
        line_end = body.find(b"\r\n", pos)
        if line_end < 0 or body[pos:line_end].strip(b" \t"):
            return None
        start = line_end + 2
        end = body.find(b"\r\n" + delimiter, start)
        if end < 0:
            return None  # no closing delimiter
        head_end = body.find(b"\r\n\r\n", start, min(end + 2, start + MAX_PART_HEADER_BYTES + 4))
        if head_end < 0 and end - start > MAX_PART_HEADER_BYTES:
            raise ServiceError(
                400,
                "invalid_multipart",
                f"a form part's headers run past {MAX_PART_HEADER_BYTES} bytes; "
                "a file name or field name that long is not accepted",
            )
        if head_end < 0 or head_end + 4 > end:
            return None  # headers not closed by a blank line of their own
        disposition = _disposition(body[start:head_end])
        if disposition is None or len(parts) == max_parts:
            return None
        parts.append(FormPart(disposition[0], disposition[1], bytes(view[head_end + 4 : end])))
        pos = end + 2 + len(delimiter)
