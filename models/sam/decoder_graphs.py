"""CUDA graphs of a compiled mask decoder (SAM's, SAM 2's), one per (prompt sets, tokens)
bucket.

Why: a decoder batch is small GPU work (a few hundred microseconds for eight clicks on an
H100) behind hundreds of kernel launches and the compiled function's guards, which took
4 to 5 ms per batch of the engine's one decoder thread (docs/BENCHMARKS.md, issue 19).
A graph replays the whole decoder as one launch.

A graph needs fixed shapes and fixed addresses, so every batch is copied into static
buffers padded to a bucket: P prompt sets up to the next captured set count (the rows
past P keep an earlier batch's data and their outputs are dropped: rows never mix), and
T tokens up to the next token bucket (the extra tokens are flagged invalid, so attention
masks them out exactly as it does the padding `pack_prompts` already adds). A batch no
graph fits (more sets or tokens than any bucket) returns None: the caller runs the
compiled decoder as before.

The decoder takes one row per prompt set of each of its image inputs: SAM's embedding
alone, or SAM 2's embedding and its two high-resolution feature maps. Each input has its
own static buffer; the decoder is called as `decode(*inputs, prompts)`.

With `graphs=False` (the CPU) the same buffers are filled and the decoder is called on
them directly: the copying and padding that a replay depends on are what the CPU tests
check.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from models.cuda_graphs import warm_and_capture
from models.sam.prompt_encoder import LABEL_NOT_A_POINT, LABEL_PAD
from models.sam.prompts import PromptBatch, PromptSet, pack_masks, prompt_tokens
from models.sam.transformer import decoder_attention

__all__ = ["TOKEN_BUCKETS", "DecoderGraphs"]

log = logging.getLogger(__name__)

# 2: one click (its point and the not-a-point token) or a box; 4: up to three clicks, or a
# box and a click; 8: up to seven clicks. Longer prompt lists run the compiled decoder.
TOKEN_BUCKETS = (2, 4, 8)

# decode(*inputs, prompts): one `[P, ...]` tensor per image input, then the prompts
Decode = Callable[..., tuple[Tensor, Tensor]]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    low_res: Tensor  # the outputs of the captured call, overwritten by each replay
    iou: Tensor


class DecoderGraphs:
    """Static buffers for the largest bucket (one per image input, and the prompts'), and
    one graph per (sets, tokens) bucket.

    The buffers are shared by every graph: a bucket of P sets uses their first P rows (a
    contiguous slice, the same strides a fresh tensor would have). Graphs replay one at a
    time, on the decoder's one thread.
    """

    def __init__(
        self,
        decode: Decode,
        *,
        embedding_shape: tuple[int, int, int] | None = None,
        input_shapes: Sequence[tuple[int, ...]] | None = None,
        mask_size: int,
        dtype: torch.dtype,
        device: torch.device,
        set_buckets: Sequence[int],
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
        graphs: bool = True,
    ) -> None:
        """`input_shapes`: one row's shape of each image input, in `decode`'s order;
        `embedding_shape` says the same of a decoder with the embedding alone (SAM's)."""
        if (embedding_shape is None) == (input_shapes is None):
            raise ValueError("DecoderGraphs needs embedding_shape or input_shapes (one of them)")
        shapes = [embedding_shape] if embedding_shape is not None else list(input_shapes or ())
        if not shapes:
            raise ValueError("DecoderGraphs needs at least one image input")
        if not set_buckets:
            raise ValueError("DecoderGraphs needs at least one set bucket")
        self.decode = decode
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.set_buckets = sorted(set(set_buckets))
        self.token_buckets = sorted(set(token_buckets))
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._captured: dict[tuple[int, int], _Captured] = {}
        rows = self.set_buckets[-1]
        with torch.inference_mode():  # as served: dynamo's guards tell the two apart
            self._images = tuple(
                torch.zeros((rows, *shape), dtype=dtype, device=device) for shape in shapes
            )
            self._mask = torch.zeros((rows, 1, mask_size, mask_size), device=device)
            self._has_mask = torch.zeros(rows, dtype=torch.bool, device=device)
            self._mask_rows_clean = True  # no row of _has_mask set: nothing to clear
            self._blobs = {t: _TokenBlob(rows, t, device) for t in self.token_buckets}
            self._tokens = {t: blob.device_views for t, blob in self._blobs.items()}

    def bucket(self, sets: int, tokens: int) -> tuple[int, int] | None:
        """The smallest (sets, tokens) bucket that holds a batch, or None."""
        s = next((b for b in self.set_buckets if b >= sets), None)
        t = next((b for b in self.token_buckets if b >= tokens), None)
        return None if s is None or t is None else (s, t)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._captured)

    def _inputs(self, sets: int, tokens: int) -> tuple[tuple[Tensor, ...], PromptBatch]:
        points, labels, valid = self._tokens[tokens]
        return tuple(buffer[:sets] for buffer in self._images), PromptBatch(
            image_index=None,
            points=points[:sets],
            point_labels=labels[:sets],
            token_valid=valid[:sets],
            mask_input=self._mask[:sets],
            has_mask_input=self._has_mask[:sets],
        )

    def capture(self, sets: int, warmup_runs: int = 2) -> float:
        """Capture every token bucket for a batch of `sets` prompt sets; seconds taken.

        The decoder runs a few times first on a side stream (compiling the shapes it has
        not met), then once under capture.
        """
        if sets not in self.set_buckets:
            raise ValueError(f"{sets} is not a set bucket {self.set_buckets}")
        started = time.perf_counter()
        for tokens in self.token_buckets:
            inputs, prompts = self._inputs(sets, tokens)
            # cuDNN attention's per-shape plans made each capture take 0.2 s (py-spy on the
            # H100 machine); a bucket's shapes are new by definition. The stages' decode
            # functions enter the same context again: it is reentrant.
            with decoder_attention(inputs[0].dtype):
                if not self.graphs:
                    low_res, iou = self.decode(*inputs, prompts)
                    self._captured[(sets, tokens)] = _Captured(None, low_res, iou)
                    continue
                with torch.cuda.device(self.device):
                    graph, (low_res, iou) = warm_and_capture(
                        functools.partial(self.decode, *inputs, prompts), self._pool, warmup_runs
                    )
            self._captured[(sets, tokens)] = _Captured(graph, low_res, iou)
        return time.perf_counter() - started

    def run_sets(
        self, inputs: Sequence[Sequence[Tensor]], sets: Sequence[PromptSet]
    ) -> tuple[Tensor, Tensor] | None:
        """Decode set p against row p of every image input (`inputs[i][p]`, one sequence
        per input in `decode`'s order) through a graph: low-res logits `[P, 4, m, m]` and
        IoU `[P, 4]` (fresh tensors, not the graph's), or None when none fits.

        The tokens are padded into a page-locked copy of the bucket's buffers on the host
        and sent in one copy (points, labels and their validity together), where building a
        `PromptBatch` on the device and copying it in took some thirty torch calls, each a
        release and retake of the GIL the engine's event loop also wants. A batch without
        mask inputs leaves the mask buffer alone (the decoder reads it only where
        `has_mask_input` is set) and clears flags an earlier batch left set."""
        if len(inputs) != len(self._images):
            raise ValueError(f"{len(inputs)} image inputs for a decoder of {len(self._images)}")
        tokens = [prompt_tokens(s) for s in sets]
        count = len(sets)
        key = self.bucket(count, max(t[0].shape[0] for t in tokens)) if tokens else None
        if key is None or key not in self._captured:
            return None
        for rows, buffer in zip(inputs, self._images, strict=True):
            if len(rows) != count:
                raise ValueError(f"{len(rows)} rows of an image input for {count} prompt sets")
            torch.stack(list(rows), out=buffer[:count])
        self._blobs[key[1]].send(tokens)
        masks, has_mask = pack_masks(sets)
        if masks is not None and has_mask is not None:
            self._mask[:count].copy_(masks)
            self._has_mask[:count].copy_(has_mask)
            self._mask_rows_clean = False
        elif not self._mask_rows_clean:
            self._has_mask.zero_()
            self._mask_rows_clean = True
        return self._replay(key, count)

    def _replay(self, key: tuple[int, int], sets: int) -> tuple[Tensor, Tensor]:
        """The bucket's graph over the filled buffers (its eager decoder without graphs);
        fresh outputs of the first `sets` rows."""
        captured = self._captured[key]
        if captured.graph is not None:
            captured.graph.replay()
            low_res, iou = captured.low_res, captured.iou
        else:
            images, padded = self._inputs(*key)
            low_res, iou = self.decode(*images, padded)
        # copies: the next replay overwrites the graph's outputs
        return _fresh_float(low_res[:sets]), _fresh_float(iou[:sets])


def _fresh_float(t: Tensor) -> Tensor:
    return t.float() if t.dtype != torch.float32 else t.clone()


class _TokenBlob:
    """One token bucket's static buffers (points `[rows, T, 2]` float32, labels `[rows, T]`
    int64, validity `[rows, T]` bool) as views of one device allocation, and its page-locked
    twin on the host, so a batch's tokens go over in one copy.

    Until a batch fills a row, it holds a single not-a-point token, so no row's attention is
    over nothing but padding. The whole blob is copied each time (4.6 KB for 32 rows of 8
    tokens): rows past a batch keep what an earlier batch left there, on both sides.
    """

    def __init__(self, rows: int, tokens: int, device: torch.device) -> None:
        n = rows * tokens
        self._spans = (8 * n, 8 * n + 8 * n, 8 * n + 8 * n + n)  # labels, points, valid
        pinned = device.type == "cuda"
        self._host = torch.zeros(self._spans[2], dtype=torch.uint8, pin_memory=pinned)
        self._device = torch.empty(self._spans[2], dtype=torch.uint8, device=device)
        self.labels, self.points, self.valid = self._numpy_views(rows, tokens)
        self.labels[:] = LABEL_PAD
        self.labels[:, 0] = LABEL_NOT_A_POINT
        self.valid[:] = self.labels != LABEL_PAD
        self.device_views = self._device_views(rows, tokens)
        self._sent = torch.cuda.Event() if device.type == "cuda" else None
        self._device.copy_(self._host)

    def _numpy_views(self, rows: int, tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        host = self._host.numpy()
        a, b, c = self._spans
        return (
            host[:a].view(np.int64).reshape(rows, tokens),
            host[a:b].view(np.float32).reshape(rows, tokens, 2),
            host[b:c].view(np.bool_).reshape(rows, tokens),
        )

    def _device_views(self, rows: int, tokens: int) -> tuple[Tensor, Tensor, Tensor]:
        """(points, labels, valid) on the device, in `_inputs`' order."""
        a, b, c = self._spans
        blob = self._device
        return (
            blob[a:b].view(torch.float32).view(rows, tokens, 2),
            blob[:a].view(torch.int64).view(rows, tokens),
            blob[b:c].view(torch.bool).view(rows, tokens),
        )

    def send(self, tokens: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Pad each set's (points, labels) into its row and copy the blob to the device, on
        the current stream, without waiting for it."""
        if self._sent is not None:
            self._sent.synchronize()  # the last copy has read the host rows rewritten here
            # (an event never recorded counts as done)
        count = len(tokens)
        self.points[:count] = 0.0
        self.labels[:count] = LABEL_PAD
        for p, (coords, kinds) in enumerate(tokens):
            self.points[p, : coords.shape[0]] = coords
            self.labels[p, : kinds.shape[0]] = kinds
        self.valid[:count] = self.labels[:count] != LABEL_PAD
        self._device.copy_(self._host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()
