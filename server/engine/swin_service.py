"""Swin's requests on the engine: classify, through its batcher."""

from __future__ import annotations

import time
from dataclasses import dataclass

from models.swin import IMAGENET_CLASSES
from server.domain import ClassifyResult, Image, ModelInfo, Prediction
from server.engine.batcher import Batcher, with_queues
from server.engine.stages import ClassifyItem, SwinStage, TopK


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


@dataclass
class SwinParts:
    stage: SwinStage
    info: ModelInfo
    batcher: Batcher[ClassifyItem, TopK]


class SwinService:
    """What a classify call does with the loaded classifier's batcher."""

    def __init__(self, parts: SwinParts) -> None:
        self.parts = parts

    async def classify(
        self, image: Image, top_k: int, deadline: float | None = None
    ) -> ClassifyResult:
        started = time.perf_counter()
        timing: dict[str, float] = {}
        top = await self.parts.batcher.submit(
            ClassifyItem(image.pixels, top_k), deadline=deadline, timing=timing
        )
        names = IMAGENET_CLASSES
        predictions = [
            Prediction(label=names[i] if i < len(names) else str(i), index=i, score=s)
            for s, i in zip(top.scores, top.indices, strict=True)
        ]
        took = {"classify": _ms(time.perf_counter() - started)}
        return ClassifyResult(predictions, timing_ms=with_queues(took, {"classify": timing}))
