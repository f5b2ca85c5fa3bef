"""JSON responses serialised with orjson.

A segment response carries each mask's RLE as text, hundreds of kilobytes for detailed
masks; the standard library's encoder ran on the event loop's thread, holding the GIL,
for about 11% of the GIL's busy time under load on an H100 (py-spy, docs/BENCHMARKS.md).
orjson writes the same JSON about ten times faster (0.14 vs 1.5 ms for a 616 KB body,
`python -m bench.host_costs` on the 2-core CPU).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse

__all__ = ["FastJSONResponse"]

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


class FastJSONResponse(JSONResponse):
    """`JSONResponse` with orjson's encoder; compact output, UTF-8, as Starlette's."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=_OPTIONS)
