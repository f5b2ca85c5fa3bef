"""The batch functions of each model stage: synchronous code for the one GPU worker thread.

Each takes a list of items from its batcher and returns one result per item. Batches are
padded up to a warmed bucket size so compiled and CUDA-graph shapes are reused; padding
slots are sliced off before results leave this module. The encoder makes no host-device
synchronisation (its embeddings stay on the device, so the worker prepares the next batch
while this one runs); the decoder waits at its end only, where the masks' runs are counted
(`nonzero`) and copied back. `python -m bench.stages` counts them on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx.experimental._config as fx_config

from models.aot import AotBuckets, AotStore
from models.fidelity import FidelityPrompt, SamOutputs
from models.images import as_pixel_tensor, nested_pixels, packed_on
from models.optimize import GraphedBuckets, OptimizeOptions, compile_fn
from models.sam import PromptSet, Sam, SamConfig, pack_prompts
from models.sam import transforms as sam_tf
from models.sam.automatic_memory import upscale_bytes
from models.sam.decoder_graphs import DecoderGraphs
from models.sam.prompts import PromptBatch
from models.sam.transformer import decoder_attention
from models.swin import SwinConfig, SwinTransformer
from models.swin import transforms as swin_tf
from models.swin.resize_kernel import packed_supported, preprocess_packed
from models.triton_device import runs_triton
from server.domain import Prompt, PromptMasks
from server.engine.cache import ImageEmbedding
from server.engine.runs import RunsCapacity, RunsGroup, low_res_runs, mask_runs
from server.rle import MaskRuns

log = logging.getLogger(__name__)

GRAPHED_SETS = 64  # decoder batches up to this many prompt sets replay a CUDA graph
# The side of the image the decoder's warm-up masks are made at. Nothing compiled or
# graphed sees the image's size (the decoder works at low-res; the runs kernel's constants
# are the mask count, not the size), but the masks' memory grows with it: 256 prompt sets
# of noise masks at 1024x1024 are 805 MB of run flags and up to 3 GB for each int64 copy
# of their run positions. With full-size masks six engines warming up on an 80 GB H100
# peaked at 80,532 of its 81,559 MiB; at 64x64 at 62,380 (docs/BENCHMARKS.md, issue 19,
# twenty-first and twenty-second sessions).
WARM_MASK_SIDE = 64


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest warmed bucket that holds `n` items (the largest if none does)."""
    for bucket in buckets:
        if bucket >= n:
            return bucket
    return buckets[-1]


def _size_key(item: DecodeItem) -> tuple[bool, tuple[int, int], tuple[int, int]]:
    """Items of one key make masks of one size and count: one upscaling, one kernel launch."""
    return item.multimask, item.embedding.input_size, item.embedding.original_size


def _spans(items: Sequence[DecodeItem]) -> list[slice]:
    """Each item's rows of a decoder call that ran every item's prompts in order."""
    spans: list[slice] = []
    start = 0
    for item in items:
        spans.append(slice(start, start + len(item.prompts)))
        start += len(item.prompts)
    return spans


def pad_batch(batch: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the leading dimension up to `size` (a no-op when already there)."""
    missing = size - batch.shape[0]
    if missing <= 0:
        return batch
    return torch.cat([batch, batch.new_zeros((missing, *batch.shape[1:]))])


@dataclass(frozen=True)
class EncodeItem:
    """One image to encode. The pixels may be a scaled decode, smaller than the image
    (`server.imaging.sam_min_size`: the model input is the same size either way);
    prompts and masks are in the image's own frame, `original_size`."""

    image_id: str
    pixels: np.ndarray | torch.Tensor  # uint8 [h, w, 3], host memory
    original_size: tuple[int, int] | None = None  # (H, W) of the image; None: the pixels'

    def size(self) -> tuple[int, int]:
        """(H, W) of the image the masks and prompts are in."""
        if self.original_size is not None:
            return self.original_size
        return int(self.pixels.shape[0]), int(self.pixels.shape[1])


@dataclass(frozen=True)
class DecodeItem:
    embedding: ImageEmbedding
    prompts: tuple[Prompt, ...]
    multimask: bool
    mask_input: torch.Tensor | None = None  # [1, m, m] low-res logits, for every prompt
    return_low_res: bool = False
    output: str = "rle"  # rle, png or polygons: rle can be made on the device


@dataclass(frozen=True)
class ClassifyItem:
    pixels: np.ndarray | torch.Tensor  # uint8 [H, W, 3], host memory; maybe a scaled decode
    top_k: int


@dataclass(frozen=True)
class TopK:
    scores: list[float]
    indices: list[int]


def stage_fn(
    fn: Callable[[torch.Tensor], torch.Tensor],
    module: torch.nn.Module,
    options: OptimizeOptions,
    aot: AotStore | None,
    stage: str,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` compiled as the options say: torch.compile, eager, or AOT packages of `module`
    (the same computation as `fn` on inputs already in the serving dtype)."""
    if options.compile_mode != "aot":
        # Swin's labels flip on small differences: compiled, it rounds as eager does
        return compile_fn(fn, options.compile_mode, dynamic=True, exact_casts=stage == "swin")
    if aot is None:
        raise ValueError("compile mode aot needs a package store (SERVE_COMPILE_CACHE_DIR)")
    return AotBuckets(module, aot, stage)


def _prepare(
    graphed: GraphedBuckets,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    compiled: bool,
) -> None:
    """Before a bucket's first batch: load or build its AOT package, compile it, and capture
    its CUDA graph. Eager code needs none of it (the warm-up's batch is the check)."""
    if not (compiled or graphed.enabled):
        return
    if isinstance(graphed.fn, AotBuckets):  # exported from a plain tensor, as it was built
        with torch.inference_mode():
            graphed.fn.prepare(torch.zeros(shape, device=device, dtype=dtype))
    with torch.inference_mode():
        # made in inference mode, as every served batch is: dynamo's guards tell the two
        # apart, so a plain example compiled a graph no batch used (uncaptured, twice)
        graphed.capture(torch.zeros(shape, device=device, dtype=dtype))


class SamStages:
    """The SAM encoder and decoder stages over one loaded model."""

    def __init__(
        self,
        model: Sam,
        config: SamConfig,
        device: torch.device,
        options: OptimizeOptions,
        encoder_buckets: Sequence[int],
        decoder_buckets: Sequence[int],
        rle_on_device: bool = False,
        work_bytes: int = 256 * 1024**2,
        aot: AotStore | None = None,
        decoder_graphs: bool = True,
        fused_runs: bool = True,
        device_strings: bool = False,
    ) -> None:
        self.model = model
        self.rle_on_device = rle_on_device
        # RLE runs straight from the low-res logits (`low_res_runs`) where the kernel runs
        self.fused_runs = fused_runs and rle_on_device and runs_triton(device)
        # ... and their COCO strings written there too (`models.sam.coco_kernel`)
        self.device_strings = device_strings and self.fused_runs
        # their one copy back's room, learnt batch by batch (None: count first, two waits)
        self.runs_capacity: RunsCapacity | None = RunsCapacity()
        self.work_bytes = work_bytes  # float logits upscaled at once (see _full_size_masks)
        self.config = config
        self.device = device
        self.dtype = options.dtype
        self.encoder_buckets = list(encoder_buckets)
        self.decoder_buckets = list(decoder_buckets)
        # One compiled graph for every bucket (dynamic batch), or one AOT package per bucket;
        # one CUDA graph per bucket.
        self._encode = GraphedBuckets(
            stage_fn(model.encode, model.image_encoder, options, aot, "sam_encoder"),
            enabled=options.cuda_graphs,
        )
        self.encoder_compiled = options.compile_mode != "none"
        decoder_mode = options.compile_mode
        if decoder_mode == "aot":
            # Prompt sets vary in number and length: no one static package fits. Eager, and
            # on a GPU replayed from the CUDA graphs below: capturing them takes a second
            # where torch.compile took 30 to 60 s even from a warm cache (issue 21).
            decoder_mode = "none"
        self.compiled = decoder_mode != "none"  # the decoder
        self._warm_entry: ImageEmbedding | None = None  # the warm-up's, for the decoder's
        self._decode = compile_fn(model.decode, decoder_mode, dynamic=True)
        # one CUDA graph per (prompt sets, tokens) bucket up to GRAPHED_SETS sets; larger
        # batches (segment everything's) run the compiled decoder
        graphed = [b for b in self.decoder_buckets if b <= GRAPHED_SETS] or [1]
        self._graphs: DecoderGraphs | None = None
        if decoder_graphs and options.cuda_graphs and device.type == "cuda":
            self._graphs = DecoderGraphs(
                self._decode_unpadded_tokens,
                embedding_shape=(config.prompt_embed_dim, *(config.embedding_size,) * 2),
                mask_size=4 * config.embedding_size,
                dtype=self.dtype,
                device=device,
                set_buckets=graphed,
            )

    @torch.inference_mode()
    def encode(self, items: list[EncodeItem]) -> list[ImageEmbedding]:
        pixels = [as_pixel_tensor(i.pixels) for i in items]
        sizes = [(int(p.shape[0]), int(p.shape[1])) for p in pixels]
        nested = nested_pixels(pixels, self.device)
        batch, input_sizes = sam_tf.preprocess_images(nested, self.config, self.device, sizes)
        bucket = bucket_for(len(items), self.encoder_buckets)
        # batch: [bucket, 3, S, S] -> embeddings [bucket, C, S/16, S/16]
        embeddings = self._encode(pad_batch(batch, bucket).to(self.dtype))
        # input sizes from the pixels, which a scaled decode keeps equal to the image's
        return [
            ImageEmbedding(item.image_id, embeddings[k].clone(), input_sizes[k], item.size())
            for k, item in enumerate(items)
        ]

    def _prompt_set(
        self, prompt: Prompt, entry: ImageEmbedding, mask_input: torch.Tensor | None
    ) -> PromptSet:
        """Clip pixel coordinates to the image, then scale them to the model input frame.

        In numpy: the GPU worker runs this for every prompt of a batch holding the GIL, and
        the same steps as small torch ops took about four times as long on the host.
        """
        height, width = entry.original_size
        limit = np.array([width, height], dtype=np.float64)

        def to_input(xy: object) -> np.ndarray:
            # clipped while still float64: a coordinate past float32's range (a client's
            # 1e300) is clipped, not first cast to inf with a warning
            clipped = np.clip(np.asarray(xy, dtype=np.float64).reshape(-1, 2), 0.0, limit)
            return self._to_input_frame(clipped.astype(np.float32), entry.original_size)

        box = None
        if prompt.box is not None:
            box = to_input(prompt.box).reshape(4)
        return PromptSet(
            points=to_input(prompt.points),
            labels=np.asarray(prompt.labels, dtype=np.int64),
            box=box,
            mask_input=mask_input,
        )

    def _to_input_frame(self, xy: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """`[N, 2]` pixel coordinates of an `(H, W)` image in the model input's frame: SAM
        scales by the longest side's resize (SAM 2 overrides: its square resize)."""
        return sam_tf.scale_coords(xy, original_size, self.config)

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> list[list[PromptMasks]]:
        low_res, iou = self._decode_low_res(items)
        return self._postprocess(items, low_res, iou)

    def _decode_low_res(self, items: list[DecodeItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every prompt set of `items`, in order, through one decoder call: float32 low-res
        logits `[P, 4, 4h, 4w]` and IoU `[P, 4]` (SAM 2 overrides: its features)."""
        # One embedding row per prompt set (the decoder repeats them per set anyway), so
        # the compiled decoder sees one batch dimension whatever mix of images a batch
        # holds: warm-up's shapes are the served shapes. With a separate image dimension,
        # every new (images, prompts) pair recompiled on the worker thread under load.
        embeddings: list[torch.Tensor] = []
        sets: list[PromptSet] = []
        for item in items:
            entry = item.embedding
            for prompt in item.prompts:
                sets.append(self._prompt_set(prompt, entry, item.mask_input))
                embeddings.append(entry.embedding)
        return self._run_decoder(embeddings, sets)

    def _run_decoder(
        self, embeddings: list[torch.Tensor], sets: list[PromptSet]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Set p against embedding p: float32 low-res logits `[P, 4, 4h, 4w]`, IoU `[P, 4]`."""
        if self._graphs is not None:  # the prompts padded and sent in one copy
            graphed = self._graphs.run_sets((embeddings,), sets)
            if graphed is not None:
                return graphed
        # compiled code sees one shape: the mask input always present, padded
        fixed = self.compiled or self._graphs is not None
        mask_size = 4 * self.config.embedding_size if fixed else None
        # no image_index: row p of the stack is set p's embedding, not gathered again
        prompts = pack_prompts(sets, None, self.device, mask_size)
        low_res, iou = self._decode_unpadded_tokens(torch.stack(embeddings), prompts)
        return low_res.float(), iou.float()

    def _decode_unpadded_tokens(
        self, embeddings: torch.Tensor, prompts: PromptBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Without duck shaping, sizes that happen to be equal when a graph is traced (2 sets
        # of 2 tokens) are not assumed equal, so no graph holds only for P == T and warm-up
        # traces one graph fewer (3, not 4).
        with fx_config.patch(use_duck_shape=False), decoder_attention(self.dtype):  # type: ignore[attr-defined]
            return self._decode(embeddings, prompts)  # type: ignore[return-value]

    def _slice_prompts(self, masks: int, size: tuple[int, int]) -> int:
        """How many prompts' masks (`masks` each) are upscaled at once within work_bytes."""
        return max(1, self.work_bytes // (masks * upscale_bytes(self.config, size)))

    def mask_memory(self, prompts: int, multimask: bool, size: tuple[int, int]) -> tuple[int, int]:
        """(held, working) bytes of one request's full-size masks on an `(H, W)` image.

        `held` lasts until its batch ends: the bool masks `[prompts, K, H, W]` and their
        copy on the way out (one byte a pixel each). `working` is the largest slice of float
        logits upscaled at once (`_full_size_masks`), one request at a time.
        """
        k = self.config.num_multimask_outputs if multimask else 1
        held = 2 * prompts * k * size[0] * size[1]
        step = min(prompts, self._slice_prompts(k, size))
        return held, step * k * upscale_bytes(self.config, size)

    def _full_size_masks(
        self, low_res: torch.Tensor, input_size: tuple[int, int], size: tuple[int, int]
    ) -> torch.Tensor:
        """Low-res logits `[P, K, m, m]` -> bool masks `[P, K, H, W]` of an `(H, W)` image.

        The float logits at full size are 4 bytes a pixel (and the padded square's as much
        again): for many prompts on a large image they are made a slice of prompts at a time,
        within `work_bytes`, never one tensor for all of them. A usual batch is one slice.
        """
        P, K = low_res.shape[:2]
        step = self._slice_prompts(K, size)

        def masks(part: slice) -> torch.Tensor:
            logits = sam_tf.postprocess_masks(low_res[part], input_size, size, self.config)
            return logits.gt(self.config.mask_threshold)

        if step >= P:
            return masks(slice(None))
        out = torch.empty((P, K, *size), dtype=torch.bool, device=low_res.device)
        for start in range(0, P, step):
            out[start : start + step] = masks(slice(start, start + step))
        return out

    @torch.inference_mode()
    def fidelity_outputs(
        self, photo: torch.Tensor, prompts: Sequence[FidelityPrompt]
    ) -> SamOutputs:
        """One photo through the served path (its encoder bucket's graph, the service's
        prompt clipping and scaling, the decoder's graphs or compiled batch call, the
        upscaling), for `models.fidelity`: SAM's and SAM 2's alike, each through its own
        `encode`, `_decode_low_res` and `_full_size_masks`. Masks in the decoder's order,
        unsorted: column 0 is what a single-mask request gets."""
        (entry,) = self.encode([EncodeItem("fidelity", photo)])
        asked = tuple(Prompt(points=p.points, labels=p.labels, box=p.box) for p in prompts)
        low_res, iou = self._decode_low_res([DecodeItem(entry, asked, multimask=True)])
        masks = self._full_size_masks(low_res, entry.input_size, entry.original_size)
        return SamOutputs(entry.embedding.float(), masks, iou)

    def _sorted_masks(
        self,
        items: list[DecodeItem],
        low_res: torch.Tensor,
        iou: torch.Tensor,
        full: Sequence[bool] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Each item's bool masks `[prompts, K, H, W]`, best score first (None for an item
        whose `full` is False, whose runs are made from the low-res logits), and its low-res
        logits in that order when it asked for them.

        Items whose images share a size (and multimask choice) are upscaled together: one
        set of kernels per group, not per request. The masks are sorted by score while
        still low-res, a gather over `[P, K, m, m]` rather than over the full-size masks;
        upscaling works per mask, so the result is the same.
        """
        wanted = [True] * len(items) if full is None else list(full)
        spans = _spans(items)
        groups: dict[tuple[bool, tuple[int, int], tuple[int, int]], list[int]] = {}
        for n, item in enumerate(items):
            if wanted[n] or item.return_low_res:
                groups.setdefault(_size_key(item), []).append(n)
        masks: list[torch.Tensor | None] = [None] * len(items)
        kept: list[torch.Tensor | None] = [None] * len(items)
        for (multimask, input_size, size), members in groups.items():
            chosen = slice(1, None) if multimask else slice(0, 1)
            rows = [spans[n] for n in members]
            low = torch.cat([low_res[r, chosen] for r in rows])
            scores = torch.cat([iou[r, chosen] for r in rows])
            # stable on both sides, so the host's score order is the same permutation
            order = scores.sort(dim=1, descending=True, stable=True).indices
            ranked = torch.take_along_dim(low, order[:, :, None, None], dim=1)
            made = None
            if any(wanted[n] for n in members):
                made = self._full_size_masks(ranked, input_size, size)
            offset = 0
            for n, r in zip(members, rows, strict=True):
                count = r.stop - r.start
                if wanted[n] and made is not None:
                    masks[n] = made[offset : offset + count]
                if items[n].return_low_res:  # the LowResStore copies each mask it keeps
                    kept[n] = self._kept_low_res(ranked[offset : offset + count])
                offset += count
        return masks, kept

    def _kept_low_res(self, ranked: torch.Tensor) -> torch.Tensor:
        """The low-res logits a refinement handle keeps, as the model's predictor hands them
        back (SAM's as they are; SAM 2 overrides: Meta's predictor clamps them)."""
        return ranked

    def _runs_from_low_res(
        self, items: list[DecodeItem], low_res: torch.Tensor, iou: torch.Tensor, which: list[int]
    ) -> dict[int, MaskRuns]:
        """The runs of items `which`, straight from the low-res logits (`low_res_runs`):
        items of one image size and multimask choice share a kernel launch."""
        spans = _spans(items)
        keyed: dict[tuple[bool, tuple[int, int], tuple[int, int]], list[int]] = {}
        for n in which:
            keyed.setdefault(_size_key(items[n]), []).append(n)
        groups = [
            RunsGroup(
                rows=[p for n in members for p in range(spans[n].start, spans[n].stop)],
                multimask=multimask,
                input_size=input_size,
                size=size,
            )
            for (multimask, input_size, size), members in keyed.items()
        ]
        # stable, as the host's ranking in _postprocess: the same permutation
        order = iou[:, 1:].sort(dim=1, descending=True, stable=True).indices
        found = low_res_runs(
            low_res, order, groups, self._mask_threshold, self._runs_square,
            self.runs_capacity, strings=self.device_strings,
        )  # fmt: skip
        out: dict[int, MaskRuns] = {}
        for members, group_runs in zip(keyed.values(), found, strict=True):
            start = 0
            for n in members:
                count = len(items[n].prompts) * (int(order.shape[1]) if items[n].multimask else 1)
                out[n] = group_runs.select(start, start + count)
                start += count
        return out

    @property
    def _mask_threshold(self) -> float:
        return float(self.config.mask_threshold)

    @property
    def _runs_square(self) -> int | None:
        """The square SAM's logits are resized to before the crop (`postprocess_masks`);
        SAM 2, with one resize, overrides it with None."""
        return int(self.config.image_size)

    def _postprocess(
        self, items: list[DecodeItem], low_res: torch.Tensor, iou: torch.Tensor
    ) -> list[list[PromptMasks]]:
        """Masks at each image's size, sorted by score, handed back in one transfer.

        With `rle_on_device`, masks wanted as RLE never cross in full: their runs are found
        on the device, straight from the low-res logits where the kernel runs
        (`fused_runs`), else from the full-size masks (`server.engine.runs`); other outputs
        (png, polygons) copy the masks back.
        """
        on_device_rle = [self.rle_on_device and item.output == "rle" for item in items]
        fused = [n for n, rle in enumerate(on_device_rle) if rle and self.fused_runs]
        full = [n not in fused for n in range(len(items))]
        all_masks, low_res_kept = self._sorted_masks(items, low_res, iou, full)
        on_device: list[torch.Tensor] = []  # [prompts * K, H, W] per item that gets runs
        flat_masks: list[torch.Tensor] = []  # flattened masks of the other items
        for n, masks in enumerate(all_masks):
            if masks is None:
                continue
            if on_device_rle[n]:
                on_device.append(masks.flatten(0, 1))
            else:
                flat_masks.append(masks.reshape(-1))
        # Queued before the blocking copies below (one of which always runs: every item's
        # masks go one way or the other), so it is complete after them without a sync of
        # its own.
        iou_on_host = iou.to("cpu", non_blocking=True)
        fused_runs = self._runs_from_low_res(items, low_res, iou, fused) if fused else {}
        runs = iter(mask_runs(on_device))
        host_masks = torch.cat(flat_masks).cpu().numpy() if flat_masks else None
        host_iou = iou_on_host.numpy()
        results: list[list[PromptMasks]] = []
        offset = start = 0
        for n, (item, masks, kept) in enumerate(zip(items, all_masks, low_res_kept, strict=True)):
            prompts = len(item.prompts)
            k = int(low_res.shape[1]) - 1 if item.multimask else 1
            chosen = slice(1, None) if item.multimask else slice(0, 1)
            scores = host_iou[start : start + prompts, chosen]
            start += prompts
            ranking = np.argsort(-scores, axis=1, kind="stable")  # the device's order, above
            sorted_scores = np.take_along_axis(scores, ranking, axis=1)
            item_runs = None
            item_masks = None
            if n in fused_runs:
                item_runs = fused_runs[n]
            elif on_device_rle[n]:
                item_runs = next(runs)
            else:
                assert host_masks is not None and masks is not None
                shape = tuple(masks.shape)
                size = int(np.prod(shape))
                item_masks = host_masks[offset : offset + size].reshape(shape)
                offset += size
            results.append(
                [
                    PromptMasks(
                        masks=None if item_masks is None else item_masks[p],
                        runs=None if item_runs is None else item_runs.select(p * k, p * k + k),
                        scores=sorted_scores[p],
                        low_res=None if kept is None else kept[p],
                    )
                    for p in range(prompts)
                ]
            )
        return results

    def warmup(self) -> None:
        """Run every encoder and decoder bucket once, so first requests meet warm paths."""
        for bucket in self.encoder_buckets:
            self.warm_encoder(bucket)
        for bucket in self.decoder_buckets:
            self.warm_decoder(bucket)

    def warm_encoder(self, bucket: int) -> None:
        """Compile (and graph) the encoder for `bucket` images, or check its eager path."""
        started = time.perf_counter()
        size = self.config.image_size
        shape = (bucket, 3, size, size)
        _prepare(self._encode, shape, self.device, self.dtype, self.encoder_compiled)
        pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8)
        embeddings = self.encode([EncodeItem(f"warmup-{k}", pixels) for k in range(bucket)])
        self._warm_entry = embeddings[0]
        log.info("warmed encoder bucket %d in %.2fs", bucket, time.perf_counter() - started)

    def warm_decoder(self, bucket: int) -> None:
        """Run the decoder on `bucket` prompt sets of every form it specialises on."""
        started = time.perf_counter()
        entry = self._warm_entry
        if entry is None:
            size = self.config.image_size
            pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8)
            (entry,) = self.encode([EncodeItem("warmup", pixels)])
            self._warm_entry = entry
        entry = replace(entry, original_size=(WARM_MASK_SIDE, WARM_MASK_SIDE))
        # Every form the compiled decoder specialises on: one set or many, few or more
        # tokens (points, box, both); the sizes between reuse the same dynamic graph.
        # Eager decoders have nothing to specialise: one form per bucket is enough.
        h, w = entry.original_size
        prompts = [
            Prompt(points=((w / 2, h / 2),), labels=(1,)),
            Prompt(points=((w / 3, h / 3), (w / 2, h / 2), (w / 4, h / 5)), labels=(1, 0, 1)),
            Prompt(box=(w / 4, h / 4, w / 2, h / 2)),
            Prompt(points=((w / 3, h / 3),), labels=(1,), box=(w / 4, h / 4, w / 2, h / 2)),
        ][: 4 if self.compiled else 1]
        if not self.compiled and self._graphs is not None and bucket != self.decoder_buckets[0]:
            prompts = []  # eager code has nothing to warm: the capture below runs it
        for prompt in prompts:
            # compiled, a refinement click (mask_input) runs the same graph: see decode
            self.decode([DecodeItem(entry, (prompt,) * bucket, multimask=True)])
        if bucket == self.decoder_buckets[0] and self.fused_runs:
            # the runs kernel compiles once per mask count: a single-mask request (a box's
            # segment) would otherwise compile it, a second on the decoder's thread
            one = Prompt(points=((w / 2, h / 2),), labels=(1,))
            self.decode([DecodeItem(entry, (one,), multimask=False)])
        if self._graphs is not None and bucket in self._graphs.set_buckets:
            try:
                with torch.inference_mode():
                    took = self._graphs.capture(bucket)
            except RuntimeError as exc:
                # a capture the device refuses (an op that syncs, a driver's limit): the
                # decoder runs as it does without graphs, and the log says why
                log.warning("decoder CUDA graphs off: capturing %d prompt sets failed (%s: %s)",
                            bucket, type(exc).__name__, str(exc)[:200])  # fmt: skip
                self._graphs = None
            else:
                log.info("captured decoder graphs for %d prompt sets in %.2fs", bucket, took)
        log.info("warmed decoder bucket %d in %.2fs", bucket, time.perf_counter() - started)


class SwinStage:
    """The Swin classifier stage."""

    def __init__(
        self,
        model: SwinTransformer,
        config: SwinConfig,
        device: torch.device,
        options: OptimizeOptions,
        buckets: Sequence[int],
        aot: AotStore | None = None,
        decoder_graphs: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = options.dtype
        self.buckets = list(buckets)
        self.compiled = options.compile_mode != "none"
        self._forward = GraphedBuckets(
            stage_fn(model, model, options, aot, "swin"), enabled=options.cuda_graphs
        )
        # Pre-processing: image by image, a dozen torch calls each, made holding the GIL
        # that the engine's event loop needs too; on CUDA, two launches for a whole batch
        # (`models.swin.resize_kernel`, Pillow's arithmetic)
        self.packed = packed_supported(device)

    @torch.inference_mode()
    def classify(self, items: list[ClassifyItem]) -> list[TopK]:
        probs = self.logits([as_pixel_tensor(i.pixels) for i in items]).softmax(dim=-1)
        k = max(item.top_k for item in items)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        scores, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
        return [
            TopK(scores[n][: item.top_k], indices[n][: item.top_k]) for n, item in enumerate(items)
        ]

    @torch.inference_mode()
    def logits(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """uint8 `[H, W, 3]` images -> float32 logits `[n, classes]`, through the warmed
        buckets (in chunks of the largest when there are more images than it holds)."""
        out = []
        step = self.buckets[-1]
        for start in range(0, len(images), step):
            chunk = images[start : start + step]
            sizes = [(int(p.shape[0]), int(p.shape[1])) for p in chunk]
            if self.packed:  # two kernel launches for the whole chunk
                values, _ = packed_on([p.reshape(-1, 3) for p in chunk], self.device)
                batch = preprocess_packed(values, sizes, self.config)
            else:
                nested = nested_pixels(list(chunk), self.device)
                batch = swin_tf.preprocess_images(nested, self.config, self.device, sizes)
            bucket = bucket_for(len(chunk), self.buckets)
            out.append(self._forward(pad_batch(batch, bucket).to(self.dtype))[: len(chunk)].float())
        return torch.cat(out)

    def warmup(self) -> None:
        """Run every bucket once before the service reports ready."""
        for bucket in self.buckets:
            self.warm(bucket)

    def warm(self, bucket: int) -> None:
        """Compile (and graph) `bucket` images, or check the eager path."""
        started = time.perf_counter()
        size = self.config.img_size
        pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8)
        shape = (bucket, 3, size, size)
        _prepare(self._forward, shape, self.device, self.dtype, self.compiled)
        self.classify([ClassifyItem(pixels, 1)] * bucket)
        log.info("warmed swin bucket %d in %.2fs", bucket, time.perf_counter() - started)
