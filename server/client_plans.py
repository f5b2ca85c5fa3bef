"""The client's calls, each written once as a *plan*: what to send, how to read the answer.

A plan is a generator that yields `Call`s (HTTP requests) or pauses (seconds) and is sent
back each response. `server.client` runs plans with httpx's blocking or asyncio client, so
request building, response parsing, the 429 retries (bounded, honouring `Retry-After`) and
the fallback on 404 `unknown_image_id` (the image sent again, once, when the client still
has its bytes) exist once for both. Imports only httpx, numpy and pycocotools.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import numpy as np

from server.client_results import (
    Classification,
    Embedding,
    EmbeddingArray,
    Everything,
    Segmentation,
    ServiceError,
    retry_after_s,
)

__all__ = ["Box", "Call", "ImageInput", "Plan", "Plans", "Point", "image_id_of"]

T = TypeVar("T")
ImageInput = bytes | str | os.PathLike[str]
Point = tuple[float, float]
Box = tuple[float, float, float, float]


@dataclass(frozen=True)
class Call:
    """One HTTP request of a plan, made by whichever httpx client runs it."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    image: bytes | None = None  # sent as multipart: file part `image`, JSON part `request`
    fields: dict[str, Any] = field(default_factory=dict)
    image_id: str | None = None  # sent as X-Image-Id: proxies route the image by it

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.image_id is not None:
            out["headers"] = {"X-Image-Id": self.image_id}
        if self.image is not None:
            out["files"] = {"image": ("image", self.image, "application/octet-stream")}
            out["data"] = {"request": json.dumps(self.fields)}
        elif self.json is not None:
            out["json"] = self.json
        return out


Step = Call | float  # a request to make, or seconds to wait before the next step
Plan = Generator[Step, httpx.Response | None, T]


def image_id_of(data: bytes) -> str:
    """The service's `image_id`: the SHA-256 of the file bytes, hex."""
    return hashlib.sha256(data).hexdigest()


def _read(image: ImageInput) -> bytes:
    if isinstance(image, bytes):
        return image
    with open(image, "rb") as f:
        return f.read()


def _error(response: httpx.Response) -> ServiceError:
    try:
        error = response.json()["error"]
        code, message = str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", response.text[:500]
    return ServiceError(
        response.status_code, code, message, retry_after_s(response.headers.get("retry-after"))
    )


class Plans:
    """The retry and fallback settings, the remembered images, and one plan per call."""

    def __init__(self, max_retries: int, max_retry_wait_s: float, remember_images: int) -> None:
        self.max_retries = max_retries
        self.max_retry_wait_s = max_retry_wait_s
        self.remember_images = remember_images
        self._images: OrderedDict[str, bytes] = OrderedDict()  # image_id -> bytes, LRU

    @staticmethod
    def headers(api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def remember(self, data: bytes) -> str:
        """Keep the bytes of an image this client sent, so a click can resend them."""
        image_id = image_id_of(data)
        if self.remember_images > 0:
            self._images[image_id] = data
            self._images.move_to_end(image_id)
            while len(self._images) > self.remember_images:
                self._images.popitem(last=False)
        return image_id

    def send(self, call: Call) -> Plan[httpx.Response]:
        """One call; a 429 waits `Retry-After` (else 0.5, 1, 2 s...) and is retried, at most
        `max_retries` times and never waiting longer than `max_retry_wait_s` at once."""
        attempt = 0
        while True:
            response = yield call
            assert response is not None
            if response.status_code == 429 and attempt < self.max_retries:
                wait = retry_after_s(response.headers.get("retry-after"))
                yield min(self.max_retry_wait_s, wait if wait is not None else 0.5 * 2**attempt)
                attempt += 1
                continue
            if response.is_error:
                raise _error(response)
            return response

    def send_json(self, call: Call) -> Plan[dict[str, Any]]:
        response = yield from self.send(call)
        body: dict[str, Any] = response.json()
        return body

    def image_call(self, path: str, image: bytes | None, image_id: str | None,
                   fields: dict[str, Any]) -> Plan[dict[str, Any]]:  # fmt: skip
        """POST the image (multipart) or its id (JSON), the id also as X-Image-Id (a proxy
        that hashes it sends every request on one image to the same replica); an id the
        server has forgotten or never saw (404 unknown_image_id: evicted, or a replica
        added or removed) is answered by sending the bytes once, if this client has them."""
        if (image is None) == (image_id is None):
            raise ValueError("give an image or an image_id, not both")
        if image is not None:
            sent_id = self.remember(image)
            call = Call("POST", path, image=image, fields=fields, image_id=sent_id)
            return (yield from self.send_json(call))
        assert image_id is not None
        by_id = Call("POST", path, {"image_id": image_id, **fields}, image_id=image_id)
        try:
            return (yield from self.send_json(by_id))
        except ServiceError as exc:
            data = self._images.get(image_id)
            if exc.code != "unknown_image_id" or data is None:
                raise
        resend = Call("POST", path, image=data, fields=fields, image_id=image_id)
        return (yield from self.send_json(resend))

    # -- the plans, one per operation ------------------------------------------------

    def embed(self, image: ImageInput) -> Plan[Embedding]:
        body = yield from self.image_call("/v1/embed", _read(image), None, {})
        return Embedding.from_json(body)

    def segment(
        self,
        image: ImageInput | None,
        image_id: str | None,
        points: Sequence[Point] | None,
        labels: Sequence[int] | None,
        box: Box | None,
        boxes: Sequence[Box] | None,
        multimask: bool,
        mask_input: str | None,
        return_low_res: bool,
    ) -> Plan[Segmentation]:
        fields: dict[str, Any] = {"multimask_output": multimask, "output": "rle"}
        if points is not None:
            fields["point_coords"] = [list(p) for p in points]
            fields["point_labels"] = list(labels) if labels is not None else [1] * len(points)
        if box is not None:
            fields["box"] = list(box)
        if boxes is not None:
            fields["boxes"] = [list(b) for b in boxes]
        if mask_input is not None:
            fields["mask_input"] = mask_input
        if return_low_res:
            fields["return_low_res_logits"] = True
        data = _read(image) if image is not None else None
        body = yield from self.image_call("/v1/segment", data, image_id, fields)
        return Segmentation.from_json(body)

    def everything(
        self, image: ImageInput | None, image_id: str | None, params: dict[str, Any]
    ) -> Plan[Everything]:
        data = _read(image) if image is not None else None
        fields = {**params, "output": "rle"}
        body = yield from self.image_call("/v1/segment/everything", data, image_id, fields)
        return Everything.from_json(body)

    def classify(self, image: ImageInput, top_k: int) -> Plan[Classification]:
        body = yield from self.image_call("/v1/classify", _read(image), None, {"top_k": top_k})
        return Classification.from_json(body)

    def embedding(self, image_id: str) -> Plan[EmbeddingArray]:
        call = Call("GET", f"/v1/embeddings/{image_id}", image_id=image_id)
        response = yield from self.send(call)

        def size(name: str) -> tuple[int, int]:
            h, w = response.headers[name].split(",")
            return int(h), int(w)

        sizes = size("x-original-size"), size("x-input-size")
        loaded = np.load(io.BytesIO(response.content), allow_pickle=False)
        if isinstance(loaded, np.ndarray):  # SAM's .npy
            return EmbeddingArray(loaded, *sizes)
        with loaded:  # SAM 2's .npz
            high_res = (loaded["high_res_feats_0"], loaded["high_res_feats_1"])
            return EmbeddingArray(loaded["image_embed"], *sizes, high_res=high_res)

    def models(self) -> Plan[dict[str, Any]]:
        return (yield from self.send_json(Call("GET", "/v1/models")))

    def ready(self) -> Plan[bool]:
        response = yield Call("GET", "/readyz")
        assert response is not None
        return response.status_code == 200
