"""SAM 2.1's encoder and decoder stages: `SamStages`' batching and mask handling, SAM 2's model.

What differs from SAM, and only that, is here:
- pre-processing stretches every image to the model's square (`models.sam2.transforms`: no
  letterbox, no padding), so prompts scale by (S / W, S / H) and every entry's input size
  is the square;
- the encoder yields the image embedding and two high-resolution feature maps; all three
  are cached together (`ImageEmbedding.high_res`) and gathered per prompt set, like the
  embedding, for one `Sam2.decode_batch` call over the prompts of many requests;
- a single-mask answer takes SAM 2's stability fallback (`select_masks`), as Meta's
  predictor does, and masks come back with one bilinear resize to the image's size;
- the low-res logits kept for a refinement handle are clamped to [-32, 32], as Meta's
  predictor returns them for its next round's `mask_input`.

The decoder replays CUDA graphs per (prompt sets, tokens) bucket as SAM's does
(`DecoderGraphs`, with three image inputs: the embedding, s0 and s1), the stability
fallback and the multimask columns inside the captured function.

The score sort, the upscaling in slices, the RLE runs on the device, the warm-up (which
captures the decoder's graphs) and the fidelity check's served path (`fidelity_outputs`,
through this class's encode, decoder and upscaling) are `SamStages`' own.
`SamStages.__init__` is not called: it builds SAM's encoder and decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch import Tensor

from models.aot import AotStore
from models.images import as_pixel_tensor, nested_pixels
from models.optimize import GraphedBuckets, OptimizeOptions, compile_fn
from models.sam import PromptSet, pack_prompts
from models.sam.decoder_graphs import DecoderGraphs
from models.sam.prompts import PromptBatch
from models.sam.transformer import decoder_attention
from models.sam2 import Sam2, Sam2Encoder, Sam2Features
from models.sam2 import transforms as sam2_tf
from models.sam2.automatic import PointDecoder, compiled_call, point_decoder
from models.sam2.mask_decoder import select_masks
from models.sam2.measure_kernel import warm_kernels
from models.triton_device import runs_triton
from server.engine.cache import ImageEmbedding
from server.engine.runs import RunsCapacity
from server.engine.stages import (
    GRAPHED_SETS,
    DecodeItem,
    EncodeItem,
    SamStages,
    bucket_for,
    pad_batch,
    stage_fn,
)

log = logging.getLogger(__name__)

# Meta's predictor clamps the low-res logits it hands back for the next round to this range
LOW_RES_CLAMP = 32.0


class Sam2Stages(SamStages):
    """The SAM 2 encoder and decoder stages over one loaded `Sam2`."""

    def __init__(
        self,
        model: Sam2,
        device: torch.device,
        options: OptimizeOptions,
        encoder_buckets: Sequence[int],
        decoder_buckets: Sequence[int],
        rle_on_device: bool = False,
        work_bytes: int = 256 * 1024**2,
        decoder_graphs: bool = True,
        fused_runs: bool = True,
        device_strings: bool = False,
        aot: AotStore | None = None,
    ) -> None:
        self.sam2 = model
        self.sam2_config = model.config
        # SAM's view of the same sizes (input square, 4x-embedding low-res masks, multimask
        # count, threshold), which the inherited mask handling reads
        self.config = model.config.prompt_config()
        self.rle_on_device = rle_on_device
        self.fused_runs = fused_runs and rle_on_device and runs_triton(device)  # as SamStages
        self.device_strings = device_strings and self.fused_runs
        self.runs_capacity: RunsCapacity | None = RunsCapacity()
        self.work_bytes = work_bytes
        self.device = device
        self.dtype = options.dtype
        self.encoder_buckets = list(encoder_buckets)
        self.decoder_buckets = list(decoder_buckets)
        # One compiled graph for every bucket (dynamic batch), or one AOT package (dynamic
        # batch too) of `Sam2Encoder`; one CUDA graph per bucket. The outputs of a graph
        # replay are overwritten by the next: `encode` copies them.
        self._encode = GraphedBuckets(
            stage_fn(self._encode_tensors, Sam2Encoder(model), options, aot, "sam2_encoder"),  # type: ignore[arg-type]
            enabled=options.cuda_graphs,
        )
        self.encoder_compiled = options.compile_mode != "none"
        # As SamStages: with AOT packages the decoder is eager (prompt sets vary in number
        # and length; no one static package fits), replayed from CUDA graphs on a GPU.
        # Segment everything's decoder call is eager too, and not graphed: compiling
        # either would bring back the minutes that packages are for.
        decoder_mode = "none" if options.compile_mode == "aot" else options.compile_mode
        self.compiled = decoder_mode != "none"  # the decoder
        self._warm_entry: ImageEmbedding | None = None
        self._decode_sets = compile_fn(self._decode_tensors, decoder_mode, dynamic=True)
        # graphs of the decoder on CUDA (SamStages.warm_decoder captures them); larger
        # batches and other devices run the decoder function itself
        self._graphs: DecoderGraphs | None = None
        if decoder_graphs and options.cuda_graphs and device.type == "cuda":
            self._graphs = self.decoder_graphs()
        # segment everything's decoder call, compiled once and shared by every request's
        # generator: on hiera-large its 16 calls per photo took 303 ms eager and 227 compiled
        # in fp32, 167 and 92 in bf16 (H100, `python -m bench.everything_stages`)
        self.everything_decode: PointDecoder | None = None
        if self.compiled:
            decode = compile_fn(point_decoder(model), options.compile_mode, dynamic=None)
            self.everything_decode = compiled_call(decode)

    def warm_everything(self, points: int) -> None:
        """Compile segment everything's decoder call for chunks of `points` prompts (the
        chunk size is dynamic: other sizes share the graph; `compiled_call` says what else
        makes every request take this graph) on zero features of one image, as the
        generator calls it (inference mode, the decoder's attention kernels, multimask),
        and the generator's measure and paint kernels where they run."""
        cfg = self.sam2_config
        d, e = cfg.d_model, cfg.embedding_size
        if runs_triton(self.device):
            warm_kernels(4 * e, self.dtype, self.device)
        if self.everything_decode is None:
            return
        shapes = [(1, d, e, e), (1, d // 8, 4 * e, 4 * e), (1, d // 4, 2 * e, 2 * e)]
        with torch.inference_mode(), decoder_attention(self.dtype):
            embed, s0, s1 = (
                torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes
            )
            points_in = torch.full((points, 2), cfg.image_size / 2, device=self.device)
            self.everything_decode(embed, s0, s1, points_in, True)

    def decoder_graphs(self, graphs: bool = True) -> DecoderGraphs:
        """The decoder's graph buffers, for sets up to GRAPHED_SETS: the embedding, s0 and s1
        rows `[D, h, w]`, `[D/8, 4h, 4w]`, `[D/4, 2h, 2w]`. `graphs=False` (and any device
        but CUDA) fills the same buffers and calls the decoder on them (the CPU tests')."""
        cfg = self.sam2_config
        d, h = cfg.d_model, cfg.embedding_size
        return DecoderGraphs(
            self._decode_features,
            input_shapes=[(d, h, h), (d // 8, 4 * h, 4 * h), (d // 4, 2 * h, 2 * h)],
            mask_size=cfg.mask_input_size,
            dtype=self.dtype,
            device=self.device,
            set_buckets=[b for b in self.decoder_buckets if b <= GRAPHED_SETS] or [1],
            graphs=graphs,
        )

    def _encode_tensors(self, images: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`[B, 3, S, S]` -> embedding `[B, D, h, w]`, s0 `[B, D/8, 4h, 4w]`,
        s1 `[B, D/4, 2h, 2w]`: tensors, so a CUDA graph can hold them."""
        features = self.sam2.encode(images)
        s0, s1 = features.high_res
        return features.image_embed, s0, s1

    def _decode_tensors(
        self, embed: Tensor, s0: Tensor, s1: Tensor, prompts: PromptBatch
    ) -> tuple[Tensor, Tensor]:
        """Set p against row p of the features: low-res logits `[P, 4, 4h, 4w]`, IoU `[P, 4]`.

        Column 0 is the single-mask answer after SAM 2's stability fallback (the best
        multimask candidate where token 0 is unstable); columns 1-3 the multimask answer.
        """
        masks, iou, _ = self.sam2.decode_batch(Sam2Features(embed, (s0, s1)), prompts)
        cfg = self.sam2_config
        single, single_iou = select_masks(
            masks, iou, False, cfg.stability_delta, cfg.stability_thresh
        )
        return torch.cat([single, masks[:, 1:]], dim=1), torch.cat([single_iou, iou[:, 1:]], 1)

    @torch.inference_mode()
    def encode(self, items: list[EncodeItem]) -> list[ImageEmbedding]:
        pixels = [as_pixel_tensor(i.pixels) for i in items]
        sizes = [(int(p.shape[0]), int(p.shape[1])) for p in pixels]
        nested = nested_pixels(pixels, self.device)
        batch = sam2_tf.preprocess_images(nested, self.sam2_config, self.device, sizes)
        bucket = bucket_for(len(items), self.encoder_buckets)
        embed, s0, s1 = self._encode(pad_batch(batch, bucket).to(self.dtype))
        square = (self.sam2_config.image_size, self.sam2_config.image_size)
        return [
            ImageEmbedding(
                item.image_id,
                embed[k].clone(),
                square,
                item.size(),
                high_res=(s0[k].clone(), s1[k].clone()),
            )
            for k, item in enumerate(items)
        ]

    def _to_input_frame(self, xy: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """x scaled by S / W and y by S / H (the square resize), in float32 and in Meta's
        order (normalise, then scale: `transforms.scale_points`)."""
        height, width = original_size
        limit = np.array([width, height], dtype=np.float32)
        return (xy / limit * np.float32(self.sam2_config.image_size)).astype(np.float32)

    def _decode_low_res(self, items: list[DecodeItem]) -> tuple[Tensor, Tensor]:
        # one row of each feature per prompt set, as SamStages stacks embeddings
        rows: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        sets: list[PromptSet] = []
        for item in items:
            entry = item.embedding
            if len(entry.high_res) != 2:
                raise ValueError(f"image {entry.image_id} has no SAM 2 high-res features")
            for prompt in item.prompts:
                sets.append(self._prompt_set(prompt, entry, item.mask_input))
                for row, tensor in zip(rows, entry.tensors, strict=True):
                    row.append(tensor)
        return self._run_sam2_decoder(*rows, sets)

    def _run_sam2_decoder(
        self, embeds: list[Tensor], s0: list[Tensor], s1: list[Tensor], sets: list[PromptSet]
    ) -> tuple[Tensor, Tensor]:
        """float32 low-res logits `[P, 4, 4h, 4w]` and IoU `[P, 4]` of set p on row p."""
        if self._graphs is not None:  # the prompts padded and sent in one copy
            graphed = self._graphs.run_sets((embeds, s0, s1), sets)
            if graphed is not None:
                return graphed
        mask_size = self.sam2_config.mask_input_size if self.compiled else None
        prompts = pack_prompts(sets, None, self.device, mask_size)
        low_res, iou = self._decode_features(
            torch.stack(embeds), torch.stack(s0), torch.stack(s1), prompts
        )
        return low_res.float(), iou.float()

    def _decode_features(
        self, embed: Tensor, s0: Tensor, s1: Tensor, prompts: PromptBatch
    ) -> tuple[Tensor, Tensor]:
        # as SamStages._decode_unpadded_tokens: no duck shaping, so P == T is not a graph of its own
        with fx_config.patch(use_duck_shape=False), decoder_attention(self.dtype):  # type: ignore[attr-defined]
            return self._decode_sets(embed, s0, s1, prompts)  # type: ignore[return-value]

    def _full_size_masks(
        self, low_res: torch.Tensor, input_size: tuple[int, int], size: tuple[int, int]
    ) -> torch.Tensor:
        """Low-res logits `[P, K, m, m]` -> bool masks `[P, K, H, W]`: one bilinear resize
        straight to the image's size (SAM 2 has no padding to crop), a slice of prompts at
        a time within `work_bytes` as `SamStages._full_size_masks` does."""
        P, K = low_res.shape[:2]
        step = self._slice_prompts(K, size)
        threshold = self.sam2_config.mask_threshold

        def masks(part: slice) -> torch.Tensor:
            logits = F.interpolate(low_res[part], size, mode="bilinear", align_corners=False)
            return logits.gt(threshold)

        if step >= P:
            return masks(slice(None))
        out = torch.empty((P, K, *size), dtype=torch.bool, device=low_res.device)
        for start in range(0, P, step):
            out[start : start + step] = masks(slice(start, start + step))
        return out

    @property
    def _mask_threshold(self) -> float:
        return float(self.sam2_config.mask_threshold)

    @property
    def _runs_square(self) -> int | None:
        return None  # one resize straight to the image's size, as _full_size_masks

    def _kept_low_res(self, ranked: Tensor) -> Tensor:
        return ranked.clamp(-LOW_RES_CLAMP, LOW_RES_CLAMP)  # as Meta's predictor hands them back
