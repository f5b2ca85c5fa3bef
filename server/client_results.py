"""What `server.client` returns: typed results with masks as numpy arrays, and its error.

Imports only numpy and pycocotools (no torch, no FastAPI), like the client itself.
"""

from __future__ import annotations

import email.utils
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from pycocotools import mask as mask_utils

__all__ = [
    "Classification",
    "Embedding",
    "EmbeddingArray",
    "Everything",
    "Mask",
    "Prediction",
    "Segmentation",
    "ServiceError",
    "retry_after_s",
]


class ServiceError(Exception):
    """The service's error envelope `{"error": {"code", "message"}}` with its HTTP status.

    `retry_after_s` is the `Retry-After` the server sent (429, 503), else None.
    """

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a `Retry-After` header: delta-seconds or an HTTP date (RFC 9110)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True)
class Mask:
    """One mask: `mask` is bool [height, width], decoded from COCO RLE with pycocotools."""

    mask: np.ndarray
    score: float
    area: int
    bbox: tuple[float, float, float, float]  # x, y, w, h
    low_res_handle: str | None = None  # with return_low_res: send back as mask_input
    stability_score: float | None = None  # segment everything only
    point_coords: tuple[float, float] | None = None  # segment everything only
    crop_box: tuple[int, int, int, int] | None = None  # segment everything only

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Mask:
        seg = obj["segmentation"]
        rle = {"size": seg["size"], "counts": seg["counts"].encode("ascii")}
        point, crop = obj.get("point_coords"), obj.get("crop_box")
        return cls(
            mask=mask_utils.decode(rle).astype(bool),
            score=float(obj["score"]),
            area=int(obj["area"]),
            bbox=tuple(float(v) for v in obj["bbox"]),  # type: ignore[arg-type]
            low_res_handle=obj.get("low_res_handle"),
            stability_score=obj.get("stability_score"),
            point_coords=tuple(point) if point is not None else None,  # type: ignore[arg-type]
            crop_box=tuple(crop) if crop is not None else None,  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class Segmentation:
    """`results[i]` holds the masks of prompt i (one per box of `boxes`), best score first."""

    image_id: str
    width: int
    height: int
    results: list[list[Mask]]
    model: dict[str, str]
    timing_ms: dict[str, float]

    @property
    def masks(self) -> list[Mask]:
        """The masks of the first (often only) prompt."""
        return self.results[0]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Segmentation:
        return cls(
            image_id=body["image_id"],
            width=body["width"],
            height=body["height"],
            results=[[Mask.from_json(m) for m in r["masks"]] for r in body["results"]],
            model=body["model"],
            timing_ms=body["timing_ms"],
        )


@dataclass(frozen=True)
class Everything:
    """Every object SAM's automatic mask generator found, best predicted IoU first."""

    image_id: str
    width: int
    height: int
    masks: list[Mask]
    model: dict[str, str]
    timing_ms: dict[str, float]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Everything:
        return cls(
            image_id=body["image_id"],
            width=body["width"],
            height=body["height"],
            masks=[Mask.from_json(m) for m in body["masks"]],
            model=body["model"],
            timing_ms=body["timing_ms"],
        )


@dataclass(frozen=True)
class Embedding:
    """The answer of `/v1/embed`: the image's embedding is cached under `image_id`."""

    image_id: str
    width: int
    height: int
    cached: bool

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Embedding:
        return cls(body["image_id"], body["width"], body["height"], body["cached"])


@dataclass(frozen=True)
class EmbeddingArray:
    """`/v1/embeddings/{image_id}`: float16 [1, 256, 64, 64] and the sizes an ONNX decoder
    needs beside it (original and resized-input height, width). A SAM 2 server's file also
    holds the two high-res maps its decoder reads, `high_res_feats_0` [1, 32, 256, 256]
    and `high_res_feats_1` [1, 64, 128, 128]; `embedding` is then its `image_embed`."""

    embedding: np.ndarray
    original_size: tuple[int, int]
    input_size: tuple[int, int]
    high_res: tuple[np.ndarray, ...] = ()  # SAM 2's (high_res_feats_0, high_res_feats_1)


@dataclass(frozen=True)
class Prediction:
    label: str
    index: int
    score: float


@dataclass(frozen=True)
class Classification:
    predictions: list[Prediction]
    model: dict[str, str]
    timing_ms: dict[str, float]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Classification:
        predictions = [Prediction(p["label"], p["index"], p["score"]) for p in body["predictions"]]
        return cls(predictions, body["model"], body["timing_ms"])
