"""OpenAPI of what the routes read by hand: image bodies (JSON or multipart) and the
X-Image-Id header. FastAPI cannot infer them, since `server.http.inputs` parses both."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from server.http.schemas import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 415, 422, 429, 503, 504)
}


def image_id_header_doc(sent_with: str) -> dict[str, Any]:
    """OpenAPI for the X-Image-Id request header (read by hand, like the bodies)."""
    return {
        "name": "X-Image-Id",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
        "description": (
            "The image's image_id (SHA-256 of the file bytes, lowercase hex), for proxies "
            "that route each image to the replica holding its embedding (consistent hash "
            f"on this header). {sent_with} 422 image_id_mismatch when it names another "
            "image, 422 invalid_request when it is not 64 lowercase hex digits."
        ),
    }


def image_body_doc(json_model: type[BaseModel], fields_model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI for bodies we parse by hand: JSON with base64/image_id, or multipart."""
    return {
        "parameters": [
            image_id_header_doc(
                "With the image bytes it must be their SHA-256; a JSON body with neither "
                "`image` nor `image_id` names its image by this header alone."
            )
        ],
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": json_model.model_json_schema()},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["image"],
                        "properties": {
                            "image": {"type": "string", "format": "binary"},
                            "request": {
                                "type": "string",
                                "description": "JSON of: " + ", ".join(fields_model.model_fields),
                            },
                        },
                    }
                },
            },
        },
    }
