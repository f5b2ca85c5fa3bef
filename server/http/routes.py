"""HTTP routes: parse, hand to the engine, shape the answer. Handlers only await."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from server import imaging, tracing
from server.domain import EverythingMasks, Image, Prompt, PromptMasks, SegmentRequest, SegmentResult
from server.errors import ServiceError, error_body
from server.http import jpeg_pass
from server.http.engine_client import EngineClient
from server.http.inputs import (
    ParsedRequest,
    check_image_id,
    image_id_header,
    mismatch,
    parse_image_request,
)
from server.http.masks import build_mask_objects
from server.http.responses import FastJSONResponse
from server.http.route_docs import ERRORS, image_body_doc, image_id_header_doc
from server.http.schemas import (
    ClassifyFields,
    ClassifyJSON,
    ClassifyResponse,
    EmbedFields,
    EmbedJSON,
    EmbedResponse,
    ErrorResponse,
    EverythingFields,
    EverythingJSON,
    EverythingResponse,
    ModelsResponse,
    NotReadyResponse,
    SegmentFields,
    SegmentJSON,
    SegmentResponse,
    is_image_id,
)
from server.http.state import ServeState, serve_state, watch_disconnect
from server.http.timing import EngineClock, ms, received_at
from server.messages import Status

router = APIRouter()


def _state(request: Request) -> ServeState:
    return serve_state(request.app.state)


async def _accept(
    request: Request, json_model: type[BaseModel], fields_model: type[BaseModel]
) -> tuple[ServeState, EngineClient, float, ParsedRequest[Any]]:
    """What every image route does first: the engine (503 while not ready), the request's
    deadline, and its body parsed (JSON with base64 or an id, or multipart)."""
    state = _state(request)
    engine = await state.require_engine()
    deadline = state.deadline(request.headers.get("x-request-timeout-ms"))
    parsed = await parse_image_request(
        request,
        json_model,
        fields_model,
        max_body_bytes=state.settings.max_body_bytes,
        in_thread=state.in_thread,
    )
    return state, engine, deadline, parsed


async def _load_image(
    state: ServeState, parsed: ParsedRequest[Any], model: str | None = None
) -> Image | None:
    """Decode and validate the image in the thread pool; None when only an id was sent.

    The pixels land in this frontend's shared memory for the engine; the request holds
    them until it ends (`_release`), the engine until it has read them. For `model`
    ("sam", "swin") a JPEG is decoded no larger than that model's resize needs.
    """
    if parsed.image_bytes is None and parsed.image_b64 is None:
        return None
    s = state.settings
    started = time.perf_counter()
    memory: imaging.PixelMemory = state.pixels if state.pixels is not None else imaging.HeapPixels()
    status = state.engine.status if state.engine is not None else None
    min_size = _min_size(state, status, model)
    # segment everything (no model named) is SAM's too
    engine_decodes = status is not None and (model or "sam") in status.jpeg_models

    def work() -> Image:
        data = parsed.image_bytes
        if data is None:
            assert parsed.image_b64 is not None
            data = imaging.decode_base64_image(parsed.image_b64, max_bytes=s.max_body_bytes)
        # The id keys SAM's embedding cache and picks an image's home engine; Swin has
        # neither, so a classification hashes its file only to check an id the client sent
        # (SHA-256 of the test photos: 0.19 ms each on the 2-core CPU; docs/BENCHMARKS.md)
        if model == "swin" and parsed.claimed_id is None:
            image_id = ""
        else:
            image_id = check_image_id(parsed.claimed_id, data)  # before any pixel is held
        if engine_decodes:
            file = jpeg_pass.for_engine(
                data,
                max_pixels=s.max_image_pixels,
                max_bytes=s.max_body_bytes,
                memory=memory,
                progressive=s.jpeg_progressive == "engine",
            )
            if file is not None:
                return Image(image_id, file.data, file.width, file.height, jpeg=True)
        decoded = imaging.decode_image(
            data,
            max_pixels=s.max_image_pixels,
            max_bytes=s.max_body_bytes,
            memory=memory,
            min_size=min_size,
        )
        return Image(image_id, decoded.pixels, decoded.width, decoded.height)

    future = asyncio.get_running_loop().run_in_executor(state.decode_pool, work)
    try:
        with tracing.span("image.decode"):
            image = await asyncio.shield(future)
    except asyncio.CancelledError:  # the decode goes on; its pixels go back when it ends
        future.add_done_callback(
            lambda f: None if f.cancelled() or f.exception() else _release(state, f.result())
        )
        raise
    state.metrics.phase("image_decode").observe(time.perf_counter() - started)
    if state.pixels is not None and state.pixels.offset_of(image.pixels) is None:
        state.metrics.pixels_inline.inc()
    return image


def _min_size(state: ServeState, status: Status | None, model: str | None) -> imaging.MinSize:
    """How small a JPEG may be decoded for `model`: the sizes its resize goes to come
    from the engine's status (the frontend does not load the model configs)."""
    if status is None or model is None or not state.settings.scaled_decode:
        return None
    if model == "sam" and status.sam_image_size is not None:
        rule = imaging.square_min_size if status.sam_square else imaging.sam_min_size
        return partial(rule, image_size=status.sam_image_size)
    if model == "swin" and status.swin_resize is not None:
        return partial(imaging.swin_min_size, resize_size=status.swin_resize)
    return None


def _release(state: ServeState, image: Image | None) -> None:
    """The request is done with its image's pixels (the engine holds its own claim)."""
    if image is not None and state.pixels is not None:
        state.pixels.release_array(image.pixels)  # type: ignore[arg-type]


_PHASES = ("encode", "decode", "generate", "classify", "encode_queue", "decode_queue",
           "classify_queue")  # fmt: skip


def _record_timing(request: Request, state: ServeState, timing: dict[str, float]) -> None:
    """Model phases into the phase histogram; all timings into the request's log line."""
    for phase in _PHASES:
        if phase in timing:
            state.metrics.phase(phase).observe(timing[phase] / 1000.0)
    request.state.timing_ms = timing


def _prompts(fields: SegmentFields, state: ServeState) -> tuple[Prompt, ...]:
    s = state.settings
    coords = [tuple(p) for p in fields.point_coords or []]
    labels = tuple(int(v) for v in fields.point_labels or [])
    if len(coords) > s.max_points:
        raise ServiceError(
            422, "invalid_request", f"{len(coords)} points; at most {s.max_points} allowed"
        )
    boxes = fields.boxes if fields.boxes is not None else [fields.box] if fields.box else []
    if len(boxes) > s.max_boxes:
        raise ServiceError(
            422, "invalid_request", f"{len(boxes)} boxes; at most {s.max_boxes} allowed"
        )
    points = tuple((float(x), float(y)) for x, y in coords)
    if not boxes:
        return (Prompt(points=points, labels=labels),)
    # Several boxes are independent prompts; points, if any, join each of them.
    return tuple(
        Prompt(points=points, labels=labels, box=tuple(float(v) for v in box))  # type: ignore[arg-type]
        for box in boxes
    )


def _result_masks(result: PromptMasks, output: str) -> list[dict[str, Any]]:
    objects = build_mask_objects(result.scores, output, masks=result.masks, runs=result.runs)
    for obj, handle in zip(objects, result.handles or [], strict=False):
        obj["low_res_handle"] = handle
    return objects


# Up to this many runs in a response, its counts strings are written on the event loop:
# about 0.1 ms of pycocotools' C writer (`python -m bench.host_costs`), less than the
# thread pool's hop costs. Masks of trained weights have hundreds of runs; random
# weights' noise masks ~100,000, which go to the pool. Strings the engine wrote on the GPU
# (SERVE_MASK_STRINGS) count as none.
INLINE_RUNS = 10_000


def _few_runs(result: SegmentResult, output: str) -> bool:
    """Whether `result`'s masks are RLE from runs the engine made, and few of them."""
    if output != "rle":
        return False
    total = 0
    for prompt in result.results:
        if prompt.runs is None:
            return False
        total += prompt.runs.runs
    return total <= INLINE_RUNS


def _segment_body(
    result: SegmentResult, output: str, model: dict[str, str], timing: dict[str, float]
) -> dict[str, Any]:
    return {
        "image_id": result.image_id,
        "width": result.width,
        "height": result.height,
        "results": [{"masks": _result_masks(r, output)} for r in result.results],
        "model": model,
        "timing_ms": timing,
    }


@router.post(
    "/v1/segment",
    response_model=SegmentResponse,
    responses=ERRORS,
    openapi_extra=image_body_doc(SegmentJSON, SegmentFields),
)
async def segment(request: Request) -> Response:
    """Masks for point/box prompts on an image (sent, or named by image_id)."""
    started = time.perf_counter()
    state, engine, deadline, parsed = await _accept(request, SegmentJSON, SegmentFields)
    fields = parsed.fields
    prompts = _prompts(fields, state)
    image = await _load_image(state, parsed, "sam")
    parsed_at = time.perf_counter()
    seg = SegmentRequest(
        prompts=prompts,
        multimask=fields.multimask_output,
        image=image,
        image_id=parsed.image_id,
        deadline=deadline,
        mask_input=fields.mask_input,
        return_low_res=fields.return_low_res_logits,
        output=fields.output,
    )
    clock = EngineClock()
    try:
        with tracing.engine_call("segment") as call:
            result = await watch_disconnect(request.receive, engine.segment(seg, clock.parts))
            clock.stop()
            call.engine_timing(result.timing_ms)
    finally:
        _release(state, image)
    computed_at = time.perf_counter()
    timing = {"parse_and_decode": ms(parsed_at - started), **result.timing_ms, **clock.timing()}
    with tracing.span("mask.encode"):
        args = (result, fields.output, engine.model_brief("sam"), timing)
        if _few_runs(result, fields.output):
            body = _segment_body(*args)  # less work than the hop to a thread and back
        else:
            body = await state.in_thread(_segment_body, *args)
    done = time.perf_counter()
    state.metrics.phase("mask_encode").observe(done - computed_at)
    body["timing_ms"]["mask_encode"] = ms(done - computed_at)
    body["timing_ms"]["total"] = ms(done - started)
    body["timing_ms"]["frontend"] = ms(done - received_at(request, started))
    _record_timing(request, state, body["timing_ms"])
    return FastJSONResponse(body)


def _everything_body(masks: EverythingMasks, output: str) -> list[dict[str, Any]]:
    objects = build_mask_objects(masks.scores, output, masks=masks.masks, runs=masks.runs)
    for k, obj in enumerate(objects):
        obj["stability_score"] = float(masks.stability[k])
        obj["point_coords"] = [float(v) for v in masks.point_coords[k]]
        obj["crop_box"] = [int(v) for v in masks.crop_boxes[k]]
    return objects


@router.post(
    "/v1/segment/everything",
    response_model=EverythingResponse,
    responses=ERRORS,
    openapi_extra=image_body_doc(EverythingJSON, EverythingFields),
)
async def segment_everything(request: Request) -> Response:
    """Every object in the image (SAM's automatic mask generator), masks best score first."""
    started = time.perf_counter()
    state, engine, deadline, parsed = await _accept(request, EverythingJSON, EverythingFields)
    fields = parsed.fields
    image = await _load_image(state, parsed)
    parsed_at = time.perf_counter()
    clock = EngineClock()
    work = engine.everything(
        image, parsed.image_id, fields.generator_fields(), fields.output, deadline, clock.parts
    )
    try:
        with tracing.engine_call("everything") as call:
            image_id, width, height, masks, timing = await watch_disconnect(request.receive, work)
            clock.stop()
            call.engine_timing(timing)
    finally:
        _release(state, image)
    computed_at = time.perf_counter()
    with tracing.span("mask.encode"):
        objects = await state.in_thread(_everything_body, masks, fields.output)
    done = time.perf_counter()
    state.metrics.phase("mask_encode").observe(done - computed_at)
    timing_ms = {
        "parse_and_decode": ms(parsed_at - started),
        **timing,
        **clock.timing(),
        "mask_encode": ms(done - computed_at),
        "total": ms(done - started),
        "frontend": ms(done - received_at(request, started)),
    }
    _record_timing(request, state, timing_ms)
    return FastJSONResponse(
        {
            "image_id": image_id,
            "width": width,
            "height": height,
            "masks": objects,
            "model": engine.model_brief("sam"),
            "timing_ms": timing_ms,
        }
    )


@router.post(
    "/v1/embed",
    response_model=EmbedResponse,
    responses=ERRORS,
    openapi_extra=image_body_doc(EmbedJSON, EmbedFields),
)
async def embed(request: Request) -> Response:
    """Run the image encoder only and cache the embedding under the image's id."""
    started = time.perf_counter()
    state, engine, deadline, parsed = await _accept(request, EmbedJSON, EmbedFields)
    image = await _load_image(state, parsed, "sam")
    clock = EngineClock()
    if image is None:
        assert parsed.image_id is not None
        with tracing.engine_call("lookup"):
            result = await engine.lookup(parsed.image_id, clock.parts)
            clock.stop()
    else:
        try:
            with tracing.engine_call("embed") as call:
                work = engine.embed(image, deadline, clock.parts)
                result = await watch_disconnect(request.receive, work)
                clock.stop()
                call.engine_timing(result.timing_ms)
        finally:
            _release(state, image)
    timing_ms = {**result.timing_ms, **clock.timing(),
                 "frontend": ms(time.perf_counter() - received_at(request, started))}  # fmt: skip
    _record_timing(request, state, timing_ms)
    return FastJSONResponse(
        {"image_id": result.image_id, "width": result.width, "height": result.height,
         "cached": result.cached, "timing_ms": timing_ms}
    )  # fmt: skip


@router.get(
    "/v1/embeddings/{image_id}",
    responses={
        404: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
        200: {
            "description": "SAM: `{image_id}.npy`; SAM 2.1: `{image_id}.npz` (float16)",
            "content": {"application/octet-stream": {}},
        },
    },
    openapi_extra={"parameters": [image_id_header_doc("It must equal the path's image_id;")]},
)
async def get_embedding(request: Request, image_id: str) -> Response:
    """The cached image's embedding in float16, for a decoder that runs in the browser
    and answers clicks without a round trip. Headers give the sizes such a decoder needs:
    `X-Original-Size` (the image's `height,width`) and `X-Input-Size` (after the model's
    resize, before padding). The file depends on the served model:

    - SAM (`vit_b`, `vit_l`, `vit_h`): `{image_id}.npy`, one array `[1, 256, 64, 64]`, the
      `image_embeddings` input of SAM's ONNX decoder.
    - SAM 2.1: `{image_id}.npz` (numpy's zip of arrays: `np.load(f, allow_pickle=False)`),
      the three inputs of the community SAM 2 ONNX decoders, under their names:
      `image_embed` `[1, 256, 64, 64]` (`no_mem_embed` added), `high_res_feats_0`
      `[1, 32, 256, 256]` and `high_res_feats_1` `[1, 64, 128, 128]` (after the mask
      decoder's `conv_s0`/`conv_s1`): about 8 MiB. The input size is the model's square,
      `1024,1024`.
    """
    state = _state(request)
    engine = await state.require_engine()
    if not is_image_id(image_id):
        raise ServiceError(422, "invalid_request", "image_id must be 64 lowercase hex digits")
    claimed = image_id_header(request)
    if claimed is not None and claimed != image_id:
        raise mismatch(claimed, image_id, "the path")
    file = await engine.embedding_file(image_id)
    return Response(
        file.data,
        media_type="application/octet-stream",
        headers={
            "Content-Disposition": f'attachment; filename="{image_id}.{file.suffix}"',
            "X-Original-Size": f"{file.original_size[0]},{file.original_size[1]}",
            "X-Input-Size": f"{file.input_size[0]},{file.input_size[1]}",
        },
    )


@router.post(
    "/v1/classify",
    response_model=ClassifyResponse,
    responses=ERRORS,
    openapi_extra=image_body_doc(ClassifyJSON, ClassifyFields),
)
async def classify(request: Request) -> Response:
    """Top-k ImageNet labels from the Swin classifier."""
    started = time.perf_counter()
    state, engine, deadline, parsed = await _accept(request, ClassifyJSON, ClassifyFields)
    if parsed.image_id is not None:
        raise ServiceError(422, "invalid_request", "classify needs the image itself, not an id")
    if parsed.fields.top_k > state.settings.max_top_k:
        raise ServiceError(422, "invalid_request", f"top_k is at most {state.settings.max_top_k}")
    image = await _load_image(state, parsed, "swin")
    assert image is not None
    parsed_at = time.perf_counter()
    clock = EngineClock()
    try:
        with tracing.engine_call("classify") as call:
            work = engine.classify(image, parsed.fields.top_k, deadline, clock.parts)
            result = await watch_disconnect(request.receive, work)
            clock.stop()
            call.engine_timing(result.timing_ms)
    finally:
        _release(state, image)
    done = time.perf_counter()
    timing_ms = {
        "parse_and_decode": ms(parsed_at - started),
        **result.timing_ms,
        **clock.timing(),
        "total": ms(done - started),
        "frontend": ms(done - received_at(request, started)),
    }
    _record_timing(request, state, timing_ms)
    return FastJSONResponse(
        {
            "predictions": [
                {"label": p.label, "index": p.index, "score": p.score} for p in result.predictions
            ],
            "model": engine.model_brief("swin"),
            "timing_ms": timing_ms,
        }
    )


@router.get("/healthz", responses={503: {"model": ErrorResponse}})
async def healthz(request: Request) -> Response:
    """Liveness: 200 while the process can serve at all (also while warming up)."""
    state = _state(request)
    if state.failure is not None:
        raise ServiceError(503, "start_failed", state.failure)
    if state.stuck is not None:
        raise ServiceError(
            503, "worker_stuck", f"a batch has been computing too long: {state.stuck}"
        )
    return FastJSONResponse({"status": "ok", "ready": state.ready, "draining": state.draining})


@router.get("/readyz", responses={503: {"model": NotReadyResponse}})
async def readyz(request: Request) -> Response:
    """Readiness: 200 once every model is loaded and warm; 503 while warming or draining."""
    state = _state(request)
    if state.draining:
        raise ServiceError(503, "not_ready", "draining")
    if state.failure is not None:
        raise ServiceError(503, "not_ready", state.failure)
    if not state.ready:
        # the error envelope, plus where the start-up is (server.progress)
        body: dict[str, Any] = error_body("not_ready", "loading or warming up")
        if state.progress is not None:
            body["progress"] = state.progress
        return FastJSONResponse(body, status_code=503)
    return FastJSONResponse({"status": "ready"})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelsResponse)
async def models(request: Request) -> Response:
    """What is loaded: names, weights source, precision, compile mode, buckets, device."""
    state = _state(request)
    loaded = state.engine.models() if state.engine is not None else []
    return FastJSONResponse(
        {
            "models": [
                {"name": m.name, "weights": m.weights, "precision": m.precision,
                 "device": m.device, "compile_mode": m.compile_mode,
                 "attention": m.attention, "cuda_graphs": m.cuda_graphs,
                 "batch_buckets": list(m.batch_buckets), "kernels": m.kernels}
                for m in loaded
            ],
            "ready": state.ready,
        }
    )  # fmt: skip
