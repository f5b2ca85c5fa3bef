"""Pydantic models of the HTTP contract (../shared/DESIGN.md): validation and OpenAPI.

Request models forbid unknown fields and non-finite numbers, so a typo or a NaN is a 422
naming the field rather than a silent default or a poisoned batch.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, model_validator

Coord = Annotated[float, Field(allow_inf_nan=False)]
Point = tuple[Coord, Coord]
Box = tuple[Coord, Coord, Coord, Coord]
ImageId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the image")]

_IMAGE_ID = re.compile(r"[0-9a-f]{64}")
# The request header that names a request's image, for proxies that route by it (they
# cannot read bodies): the image_id, which a client computes before sending the bytes.
IMAGE_ID_HEADER = "x-image-id"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageSource(_Strict):
    """Exactly one of `image` (base64 file bytes) or `image_id`, for JSON bodies."""

    image: str | None = Field(None, description="base64 of the image file bytes")
    image_id: ImageId | None = None

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo) -> ImageSource:
        # A body with neither names its image by the X-Image-Id header, when one came
        # (`server.http.inputs` passes it as the context): the id a proxy routed on.
        header = info.context.get(IMAGE_ID_HEADER) if isinstance(info.context, dict) else None
        if self.image is None and self.image_id is None and header is not None:
            self.image_id = header
        if (self.image is None) == (self.image_id is None):
            raise ValueError(
                "give exactly one of 'image' (base64) or 'image_id' (or the X-Image-Id header)"
            )
        return self


class SegmentFields(_Strict):
    """Prompt fields of `/v1/segment`, shared by the JSON and multipart forms."""

    point_coords: list[Point] | None = Field(None, description="[[x, y], ...] in pixels")
    # StrictInt first: a bare Literal[0, 1] would take JSON's `true` as 1
    point_labels: list[Annotated[StrictInt, Field(ge=0, le=1)]] | None = Field(
        None, description="1 foreground, 0 background"
    )
    box: Box | None = Field(None, description="[x0, y0, x1, y1] in pixels")
    boxes: list[Box] | None = Field(None, description="several boxes: one result each")
    multimask_output: bool = False
    output: Literal["rle", "png", "polygons"] = "rle"
    return_low_res_logits: bool = Field(
        False, description="give each mask a low_res_handle, to send back as mask_input"
    )
    mask_input: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")] | None = Field(
        None, description="a low_res_handle from an earlier response on the same image"
    )

    @model_validator(mode="after")
    def _consistent(self) -> SegmentFields:
        coords, labels = self.point_coords, self.point_labels
        if (coords is None) != (labels is None):
            raise ValueError("point_coords and point_labels go together")
        if coords is not None and labels is not None and len(coords) != len(labels):
            raise ValueError(
                f"point_coords has {len(coords)} points but point_labels has {len(labels)}"
            )
        if self.box is not None and self.boxes is not None:
            raise ValueError("give 'box' or 'boxes', not both")
        if self.boxes is not None and not self.boxes:
            raise ValueError("'boxes' is empty")
        for box in [self.box] if self.box is not None else self.boxes or []:
            if box[2] < box[0] or box[3] < box[1]:
                raise ValueError(f"box {list(box)} has x1 < x0 or y1 < y0")
        if not coords and self.box is None and not self.boxes and self.mask_input is None:
            raise ValueError(
                "give at least one prompt: point_coords/point_labels, box, boxes or mask_input"
            )
        return self


class SegmentJSON(ImageSource, SegmentFields):
    """`application/json` body of `/v1/segment`."""


class EverythingFields(_Strict):
    """Fields of `/v1/segment/everything`: the arguments of Meta's `SamAutomaticMaskGenerator`
    (SAM) or `SAM2AutomaticMaskGenerator` (SAM 2.1). Defaults shown are SAM's: a field the
    request leaves out takes the served model's generator default."""

    points_per_side: int = Field(32, ge=1, le=128)
    points_per_batch: int = Field(64, ge=1, le=1024)
    pred_iou_thresh: float = Field(0.88, ge=0.0, le=1.0, description="SAM 2.1 default: 0.8")
    stability_score_thresh: float = Field(0.95, ge=0.0, le=1.0)
    stability_score_offset: float = Field(1.0, ge=0.0, le=100.0)
    box_nms_thresh: float = Field(0.7, ge=0.0, le=1.0)
    crop_n_layers: int = Field(0, ge=0, le=3)
    crop_nms_thresh: float = Field(0.7, ge=0.0, le=1.0)
    crop_overlap_ratio: float = Field(512 / 1500, ge=0.0, lt=1.0)
    crop_n_points_downscale_factor: int = Field(1, ge=1, le=16)
    min_mask_region_area: int = Field(0, ge=0, le=10_000_000)
    # SAM 2.1's generator only (a SAM model answers 422)
    mask_threshold: float | None = Field(None, ge=-1000.0, le=1000.0, description="SAM 2.1: 0")
    multimask_output: bool | None = Field(None, description="SAM 2.1 only: default true")
    use_m2m: bool | None = Field(None, description="SAM 2.1 only: default false")
    output: Literal["rle", "png", "polygons"] = "rle"

    def generator_fields(self) -> dict[str, float | int]:
        """Only what the request set: the rest takes the served model's own defaults."""
        return self.model_dump(exclude={"output"}, exclude_unset=True, exclude_none=True)


class EverythingJSON(ImageSource, EverythingFields):
    """`application/json` body of `/v1/segment/everything`."""


class ClassifyFields(_Strict):
    top_k: int = Field(5, ge=1, le=1000)


class ClassifyJSON(ImageSource, ClassifyFields):
    """`application/json` body of `/v1/classify`."""


class EmbedFields(_Strict):
    """`/v1/embed` takes no fields besides the image."""


class EmbedJSON(ImageSource, EmbedFields):
    """`application/json` body of `/v1/embed` (an image_id only checks the cache)."""


# -- responses -----------------------------------------------------------------------


class ModelBrief(BaseModel):
    name: str
    weights: str
    precision: str


class MaskObject(BaseModel):
    segmentation: dict[str, object] = Field(
        description="COCO RLE {size, counts}; or {size, png} / {size, polygons}"
    )
    score: float = Field(description="the model's predicted IoU")
    area: int
    bbox: list[float] = Field(description="[x, y, w, h]")
    low_res_handle: str | None = Field(
        None, description="with return_low_res_logits: pass as mask_input to refine this mask"
    )
    stability_score: float | None = Field(None, description="segment everything only")
    point_coords: list[float] | None = Field(None, description="segment everything only")
    crop_box: list[int] | None = Field(None, description="segment everything only, [x, y, w, h]")


class PromptResult(BaseModel):
    masks: list[MaskObject]


class SegmentResponse(BaseModel):
    image_id: str
    width: int
    height: int
    results: list[PromptResult]
    model: ModelBrief
    timing_ms: dict[str, float]


class EverythingResponse(BaseModel):
    image_id: str
    width: int
    height: int
    masks: list[MaskObject] = Field(description="best predicted IoU first")
    model: ModelBrief
    timing_ms: dict[str, float]


class EmbedResponse(BaseModel):
    image_id: str
    width: int
    height: int
    cached: bool
    timing_ms: dict[str, float] = Field(default_factory=dict)


class PredictionOut(BaseModel):
    label: str
    index: int
    score: float


class ClassifyResponse(BaseModel):
    predictions: list[PredictionOut]
    model: ModelBrief
    timing_ms: dict[str, float]


class ModelDetail(BaseModel):
    name: str
    weights: str
    precision: str
    device: str
    compile_mode: str
    attention: str
    cuda_graphs: bool
    batch_buckets: list[int]
    kernels: str


class ModelsResponse(BaseModel):
    models: list[ModelDetail]
    ready: bool


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StartupProgressOut(BaseModel):
    """Where a start-up is: step `step` of `of` (`doing`), `seconds` since process start."""

    step: int
    of: int
    doing: str
    seconds: float


class NotReadyResponse(ErrorResponse):
    """/readyz's 503: the error envelope, with the start-up's progress while warming."""

    progress: StartupProgressOut | None = None


def is_image_id(value: str) -> bool:
    """Whole-string match: `re.match` with `$` would let a trailing newline through."""
    return _IMAGE_ID.fullmatch(value) is not None
