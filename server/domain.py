"""Plain request and result types between the HTTP layer and the engine.

The engine speaks these dataclasses rather than pydantic models, so it can be driven by
tests, benchmarks and the routes alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from server.rle import MaskRuns

if TYPE_CHECKING:  # the frontends never import torch; the engine's tensors are typed so
    import torch


@dataclass(frozen=True)
class Image:
    """A decoded, validated image and its content id.

    The pixels may be a scaled decode, smaller than the image (for a model that shrinks it
    anyway, `server.imaging.decode_image`'s `min_size`); width and height are always
    the image's own, which prompts, masks and responses are in."""

    image_id: str  # SHA-256 of the file bytes; "" for a classification (no cache keys it)
    pixels: Any  # uint8 [H, W, 3]: np.ndarray in a frontend, torch.Tensor in the engine
    width: int
    height: int
    # in a frontend: `pixels` are a baseline JPEG file's bytes `[n]` for the engine to
    # decode (`server.http.jpeg_pass`); the engine's images are always pixels
    jpeg: bool = False


@dataclass(frozen=True)
class Prompt:
    """One independent prompt on an image: points, a box, or both; pixel coordinates."""

    points: tuple[tuple[float, float], ...] = ()
    labels: tuple[int, ...] = ()
    box: tuple[float, float, float, float] | None = None


@dataclass(frozen=True)
class SegmentRequest:
    prompts: tuple[Prompt, ...]
    multimask: bool = False
    image: Image | None = None
    image_id: str | None = None
    deadline: float | None = None  # time.monotonic() instant
    mask_input: str | None = None  # a low-res handle from an earlier response on this image
    return_low_res: bool = False  # hand out handles for the returned masks
    output: str = "rle"  # rle, png or polygons


@dataclass
class PromptMasks:
    """The masks for one prompt, best score first."""

    masks: np.ndarray | None  # bool [K, H, W], unless the runs below stand for them
    scores: np.ndarray  # float32 [K]
    runs: MaskRuns | None = None  # COCO runs made on the device (RLE output on CUDA)
    low_res: torch.Tensor | None = None  # [K, m, m] logits on the device, when asked for
    handles: list[str] | None = None  # their `mask_input` handles, set by the engine


@dataclass
class SegmentResult:
    image_id: str
    width: int
    height: int
    cached: bool
    results: list[PromptMasks]
    timing_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbedResult:
    image_id: str
    width: int
    height: int
    cached: bool
    timing_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class Prediction:
    label: str
    index: int
    score: float


@dataclass
class ClassifyResult:
    predictions: list[Prediction]
    timing_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelInfo:
    """What `/v1/models` and every response's `model` field say about a loaded model."""

    name: str
    weights: str  # "random", "synthetic" (models.provenance) or the checkpoint file name
    precision: str  # the variant: "fp32", "bf16", "bf16+fp8", "bf16+int8+2:4", ...
    device: str
    compile_mode: str
    attention: str
    cuda_graphs: bool
    batch_buckets: tuple[int, ...]
    kernels: str = "triton"  # SERVE_KERNELS resolved: "gluon" or "triton" (the int8 GEMMs'
    # and SAM's attention kernels on CUDA; eager CPU models name "triton" and run none)

    def brief(self) -> dict[str, str]:
        return {"name": self.name, "weights": self.weights, "precision": self.precision}


@dataclass(frozen=True)
class EmbeddingFile:
    """A cached image's embedding as the file a decoder in the browser loads beside the
    sizes it needs (`SamService.embedding_file` says what the arrays are)."""

    data: bytes
    suffix: str  # "npy" (SAM: one array) or "npz" (SAM 2: its three feature maps)
    original_size: tuple[int, int]  # (H, W) of the image
    input_size: tuple[int, int]  # (h, w) after the model's resize, before any padding


@dataclass
class EverythingMasks:
    """Host copies of the final masks, best predicted IoU first."""

    masks: np.ndarray | None  # bool [N, H, W], unless `runs` stand for them
    runs: MaskRuns | None  # COCO runs made on the device (RLE output with rle_on_device)
    scores: np.ndarray  # float32 [N] predicted IoU
    stability: np.ndarray  # float32 [N]
    point_coords: np.ndarray  # float32 [N, 2], the prompt that made each mask
    crop_boxes: np.ndarray  # int64 [N, 4] XYWH
    steps: int
