"""A Python client for the service: `Client` (blocking) and `AsyncClient` (asyncio).

    from server.client import Client
    with Client("http://127.0.0.1:8000", api_key="...") as c:
        emb = c.embed("dog.jpg")                          # encoder once, cached by image_id
        seg = c.click(emb.image_id, [(400, 260)], [1])    # then clicks name the image
        seg.masks[0].mask                                 # numpy bool [height, width]

Every call is written once, as a *plan*: a generator that yields the HTTP calls to make
(or a pause, in seconds) and gets back each response. `Client` runs plans with
`httpx.Client` and `time.sleep`, `AsyncClient` with `httpx.AsyncClient` and
`asyncio.sleep`, so request building, response parsing, the 429 retries (bounded, honouring
`Retry-After`) and the fallback on 404 `unknown_image_id` (the image is sent again, once,
when this client still has its bytes) are the same code for both.

Imports only httpx, numpy and pycocotools: a client installs and starts without torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import time
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

__all__ = ["AsyncClient", "Client", "ServiceError", "image_id_of"]

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

    def kwargs(self) -> dict[str, Any]:
        if self.image is not None:
            return {
                "files": {"image": ("image", self.image, "application/octet-stream")},
                "data": {"request": json.dumps(self.fields)},
            }
        return {"json": self.json} if self.json is not None else {}


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


class _Core:
    """Settings and the plans; the two clients only differ in how they run a plan."""

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
        """POST the image (multipart) or its id (JSON); an id the server has forgotten
        (404 unknown_image_id) is answered by sending the bytes once, if this client has them."""
        if image is not None:
            self.remember(image)
            return (yield from self.send_json(Call("POST", path, image=image, fields=fields)))
        if image_id is None:
            raise ValueError("give an image or an image_id")
        try:
            return (yield from self.send_json(Call("POST", path, {"image_id": image_id, **fields})))
        except ServiceError as exc:
            data = self._images.get(image_id)
            if exc.code != "unknown_image_id" or data is None:
                raise
        return (yield from self.send_json(Call("POST", path, image=data, fields=fields)))

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
        response = yield from self.send(Call("GET", f"/v1/embeddings/{image_id}"))

        def size(name: str) -> tuple[int, int]:
            h, w = response.headers[name].split(",")
            return int(h), int(w)

        array = np.load(io.BytesIO(response.content), allow_pickle=False)
        return EmbeddingArray(array, size("x-original-size"), size("x-input-size"))

    def models(self) -> Plan[dict[str, Any]]:
        return (yield from self.send_json(Call("GET", "/v1/models")))

    def ready(self) -> Plan[bool]:
        response = yield Call("GET", "/readyz")
        assert response is not None
        return response.status_code == 200


def _timeout(timeout: float | httpx.Timeout) -> httpx.Timeout:
    return timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)


class Client:
    """Blocking client. `timeout` (s) bounds each HTTP exchange; a 429 is retried up to
    `max_retries` times after its `Retry-After`; `api_key` goes as `Authorization: Bearer`.
    The bytes of the last `remember_images` images sent are kept for the 404 fallback."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        max_retry_wait_s: float = 30.0,
        remember_images: int = 16,
        http: httpx.Client | None = None,
    ) -> None:
        self.core = _Core(max_retries, max_retry_wait_s, remember_images)
        self.http = http or httpx.Client(
            base_url=base_url, headers=_Core.headers(api_key), timeout=_timeout(timeout)
        )

    def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Call):
                    response = self.http.request(step.method, step.path, **step.kwargs())
                    step = plan.send(response)
                else:
                    time.sleep(step)
                    step = plan.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def embed(self, image: ImageInput) -> Embedding:
        return self._run(self.core.embed(image))

    def segment(
        self,
        image: ImageInput | None = None,
        *,
        image_id: str | None = None,
        points: Sequence[Point] | None = None,
        labels: Sequence[int] | None = None,
        box: Box | None = None,
        boxes: Sequence[Box] | None = None,
        multimask: bool = False,
        mask_input: str | None = None,
        return_low_res: bool = False,
    ) -> Segmentation:
        plan = self.core.segment(
            image, image_id, points, labels, box, boxes, multimask, mask_input, return_low_res
        )
        return self._run(plan)

    def click(
        self,
        image_id: str,
        points: Sequence[Point],
        labels: Sequence[int],
        *,
        mask_input: str | None = None,
        multimask: bool = False,
        return_low_res: bool = False,
    ) -> Segmentation:
        """A click on an embedded image: `segment` by `image_id`."""
        return self.segment(
            image_id=image_id, points=points, labels=labels, mask_input=mask_input,
            multimask=multimask, return_low_res=return_low_res,
        )  # fmt: skip

    def everything(
        self, image: ImageInput | None = None, *, image_id: str | None = None, **params: Any
    ) -> Everything:
        """`params`: Meta's SamAutomaticMaskGenerator arguments (points_per_side, ...)."""
        return self._run(self.core.everything(image, image_id, params))

    def classify(self, image: ImageInput, top_k: int = 5) -> Classification:
        return self._run(self.core.classify(image, top_k))

    def embedding(self, image_id: str) -> EmbeddingArray:
        return self._run(self.core.embedding(image_id))

    def models(self) -> dict[str, Any]:
        return self._run(self.core.models())

    def ready(self) -> bool:
        return self._run(self.core.ready())

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The same calls as `Client`, awaited; the same arguments and behaviour."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 60.0,
        max_retries: int = 3,
        max_retry_wait_s: float = 30.0,
        remember_images: int = 16,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.core = _Core(max_retries, max_retry_wait_s, remember_images)
        self.http = http or httpx.AsyncClient(
            base_url=base_url, headers=_Core.headers(api_key), timeout=_timeout(timeout)
        )

    async def _run(self, plan: Plan[T]) -> T:
        try:
            step = next(plan)
            while True:
                if isinstance(step, Call):
                    response = await self.http.request(step.method, step.path, **step.kwargs())
                    step = plan.send(response)
                else:
                    await asyncio.sleep(step)
                    step = plan.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    async def embed(self, image: ImageInput) -> Embedding:
        return await self._run(self.core.embed(image))

    async def segment(
        self,
        image: ImageInput | None = None,
        *,
        image_id: str | None = None,
        points: Sequence[Point] | None = None,
        labels: Sequence[int] | None = None,
        box: Box | None = None,
        boxes: Sequence[Box] | None = None,
        multimask: bool = False,
        mask_input: str | None = None,
        return_low_res: bool = False,
    ) -> Segmentation:
        plan = self.core.segment(
            image, image_id, points, labels, box, boxes, multimask, mask_input, return_low_res
        )
        return await self._run(plan)

    async def click(
        self,
        image_id: str,
        points: Sequence[Point],
        labels: Sequence[int],
        *,
        mask_input: str | None = None,
        multimask: bool = False,
        return_low_res: bool = False,
    ) -> Segmentation:
        return await self.segment(
            image_id=image_id, points=points, labels=labels, mask_input=mask_input,
            multimask=multimask, return_low_res=return_low_res,
        )  # fmt: skip

    async def everything(
        self, image: ImageInput | None = None, *, image_id: str | None = None, **params: Any
    ) -> Everything:
        return await self._run(self.core.everything(image, image_id, params))

    async def classify(self, image: ImageInput, top_k: int = 5) -> Classification:
        return await self._run(self.core.classify(image, top_k))

    async def embedding(self, image_id: str) -> EmbeddingArray:
        return await self._run(self.core.embedding(image_id))

    async def models(self) -> dict[str, Any]:
        return await self._run(self.core.models())

    async def ready(self) -> bool:
        return await self._run(self.core.ready())

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
