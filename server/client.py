"""A Python client for the service: `Client` (blocking) and `AsyncClient` (asyncio).

    from server.client import Client
    with Client("http://127.0.0.1:8000", api_key="...") as c:
        emb = c.embed("dog.jpg")                          # encoder once, cached by image_id
        seg = c.click(emb.image_id, [(400, 260)], [1])    # then clicks name the image
        seg.masks[0].mask                                 # numpy bool [height, width]

Every call is written once, as a *plan* (`server/client_plans.py`): a generator that yields
the HTTP calls to make (or a pause, in seconds) and gets back each response. `Client` runs
plans with `httpx.Client` and `time.sleep`, `AsyncClient` with `httpx.AsyncClient` and
`asyncio.sleep`, so request building, response parsing, the 429 retries (bounded, honouring
`Retry-After`) and the fallback on 404 `unknown_image_id` (the image is sent again, once,
when this client still has its bytes) are the same code for both. Every request on an image
names it in an `X-Image-Id` header, which a proxy can hash to send all of them to the
replica that holds its embedding (docs/DEPLOYMENT.md, "Affinity between pods").

Imports only httpx, numpy and pycocotools: a client installs and starts without torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx

from server.client_plans import Box, Call, ImageInput, Plan, Plans, Point, image_id_of
from server.client_results import (
    Classification,
    Embedding,
    EmbeddingArray,
    Everything,
    Mask,
    Prediction,
    Segmentation,
    ServiceError,
)

__all__ = [
    "AsyncClient",
    "Classification",
    "Client",
    "Embedding",
    "EmbeddingArray",
    "Everything",
    "Mask",
    "Prediction",
    "Segmentation",
    "ServiceError",
    "image_id_of",
]

T = TypeVar("T")


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
        self.core = Plans(max_retries, max_retry_wait_s, remember_images)
        self.http = http or httpx.Client(
            base_url=base_url, headers=Plans.headers(api_key), timeout=_timeout(timeout)
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
        self.core = Plans(max_retries, max_retry_wait_s, remember_images)
        self.http = http or httpx.AsyncClient(
            base_url=base_url, headers=Plans.headers(api_key), timeout=_timeout(timeout)
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
