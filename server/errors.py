"""The one error type of the service and its JSON envelope.

Anything a client did wrong, or any state that refuses it (not ready, queue full), is a
`ServiceError` with an HTTP status and a stable snake_case code; the app turns it into
`{"error": {"code", "message"}}`. Nothing else should reach the client as a 500.
"""

from __future__ import annotations

__all__ = ["ServiceError", "clip", "error_body"]


class ServiceError(Exception):
    """An error with the status, code and message the client will see."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers

    def __repr__(self) -> str:
        return f"ServiceError({self.status}, {self.code!r}, {self.message!r})"


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    """The envelope every error response carries."""
    return {"error": {"code": code, "message": message}}


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how long it was: what a client sent is
    echoed in messages and logs, and a 19 MB JSON key must not become a 19 MB answer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"
