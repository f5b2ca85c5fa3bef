"""Locust load test for sam-swin-serve: interactive annotation, box segmentation, classification.

Three kinds of users, weighted 3 : 2 : 1, send real photos from a folder:

- `AnnotatorUser`: embeds an image once (`POST /v1/embed`), then clicks several times
  (`POST /v1/segment` with `image_id` and the points so far), pausing between clicks.
- `BoxSegmentUser`: one-shot `POST /v1/segment`, multipart (the image file plus a JSON
  `request` part) with one to four boxes.
- `ClassifyUser`: `POST /v1/classify`, multipart, top 5.

Every 200 is checked for content, not just status: the image id is the SHA-256 of the bytes,
sizes match the photo, one result per box, masks sorted by score, every RLE decodes with
pycocotools to the image's size and its pixel count equals `area`, predictions sorted.
A 429 (queue full) is not a failure: it is counted in its own row (`... [429]`).

Every request names its photo in an `X-Image-Id` header (the SHA-256 of the bytes), as the
service's clients do: through a proxy that hashes it (docs/DEPLOYMENT.md, "Affinity between
pods") each annotator's clicks reach the replica that embedded its photo, and a click
answered 404 `unknown_image_id` is a failure, which is how a run shows routing that fails.

Requests go through Locust's own HTTP session (its statistics and the 429 rows need it),
not `server.client`; the checks use the client's reading of a mask object
(`server.client.Mask`, pycocotools underneath) and its `image_id_of`, so the load test and
the client agree on what a valid answer is. They import from this checkout (the folder
above this file), which needs httpx, numpy and pycocotools but not torch.

Headless run with CSV output (see docs/DEPLOYMENT.md)::

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 2m \
        --host http://127.0.0.1:8000 --csv results/run

Environment:
    LOADTEST_IMAGES   folder of .jpg/.jpeg photos (default ../shared/data/images beside
                      the repository); never commit photos into the project
    LOADTEST_API_KEY  sent as `Authorization: Bearer <key>` when set
    LOADTEST_STAGES   load profile of `RampShape`: unset for a flat run of -u users at -r,
                      `ramp` for the built-in profile, or stages
                      `DURATION:USERS[:SPAWN_RATE],...` such as `1m:8,3m:32:2,30s:0`;
                      -t caps the run in every case
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Any

from locust import HttpUser, LoadTestShape, between, task
from PIL import Image, ImageOps

# Locust puts only this file's folder on sys.path: the repository root gives `server.client`
# of this same checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.client import Mask, image_id_of

DEFAULT_IMAGES = Path(__file__).resolve().parents[2] / "shared" / "data" / "images"
RAMP = "1m:4,2m:16,2m:32,2m:64,1m:8"
TOP_K = 5


class ContentError(ValueError):
    """A 200 whose body breaks the HTTP contract."""


# -- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Photo:
    """One photo as sent: its bytes, its size as the server sees it (EXIF-oriented), its id."""

    name: str
    data: bytes
    width: int
    height: int
    sha256: str

    @classmethod
    def read(cls, path: Path) -> Photo:
        data = path.read_bytes()
        with Image.open(path) as im:
            width, height = (ImageOps.exif_transpose(im) or im).size
        return cls(path.name, data, width, height, image_id_of(data))


@cache
def photos() -> tuple[Photo, ...]:
    """The photos of LOADTEST_IMAGES, read once per process (not at import)."""
    folder = Path(os.environ.get("LOADTEST_IMAGES") or DEFAULT_IMAGES)
    paths = sorted(p for p in folder.glob("*") if p.suffix.lower() in {".jpg", ".jpeg"})
    if not paths:
        raise RuntimeError(f"no .jpg/.jpeg photos in {folder} (set LOADTEST_IMAGES)")
    return tuple(Photo.read(p) for p in paths)


def auth_headers() -> dict[str, str]:
    key = os.environ.get("LOADTEST_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def random_box(photo: Photo, rng: random.Random) -> list[float]:
    """A box of 10-40% of each side, inside the image: [x0, y0, x1, y1]."""
    w, h = photo.width, photo.height
    bw, bh = rng.uniform(0.1, 0.4) * w, rng.uniform(0.1, 0.4) * h
    x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
    return [round(x0, 1), round(y0, 1), round(x0 + bw, 1), round(y0 + bh, 1)]


def random_point(photo: Photo, rng: random.Random) -> list[float]:
    return [round(rng.uniform(0, photo.width - 1), 1), round(rng.uniform(0, photo.height - 1), 1)]


# -- response checks (pure functions: tests/deploy exercises them without a server) --------


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContentError(message)


def check_image_fields(body: dict[str, Any], photo: Photo, image_id: str) -> None:
    _expect(body.get("image_id") == image_id, f"image_id {body.get('image_id')!r} != {image_id}")
    size = (body.get("width"), body.get("height"))
    _expect(size == (photo.width, photo.height), f"size {size} != {photo.width}x{photo.height}")


def check_masks(masks: list[dict[str, Any]], photo: Photo, expected: int) -> None:
    """`expected` masks, best score first, each RLE decoding to the image with `area` pixels."""
    _expect(len(masks) == expected, f"{len(masks)} masks, expected {expected}")
    scores = [m["score"] for m in masks]
    _expect(scores == sorted(scores, reverse=True), f"masks not sorted by score: {scores}")
    for m in masks:
        seg = m["segmentation"]
        size = [photo.height, photo.width]
        _expect(seg["size"] == size, f"segmentation size {seg['size']} != {size}")
        mask = Mask.from_json(m)
        shape = mask.mask.shape
        _expect(shape == tuple(size), f"RLE decodes to {shape}, not {size}")
        area = int(mask.mask.sum())
        _expect(area == mask.area, f"RLE has {area} pixels, area says {mask.area}")


def check_segment(
    body: dict[str, Any], photo: Photo, image_id: str, results: int, multimask: bool
) -> None:
    check_image_fields(body, photo, image_id)
    got = body["results"]
    _expect(len(got) == results, f"{len(got)} results for {results} prompts")
    for result in got:
        check_masks(result["masks"], photo, 3 if multimask else 1)


def check_embed(body: dict[str, Any], photo: Photo) -> None:
    check_image_fields(body, photo, photo.sha256)
    _expect(isinstance(body.get("cached"), bool), f"cached is {body.get('cached')!r}")


def check_classify(body: dict[str, Any], top_k: int) -> None:
    predictions = body["predictions"]
    _expect(len(predictions) == top_k, f"{len(predictions)} predictions, asked for {top_k}")
    scores = [p["score"] for p in predictions]
    _expect(scores == sorted(scores, reverse=True), f"predictions not sorted: {scores}")
    _expect(all(0.0 <= s <= 1.0 for s in scores), f"scores outside [0, 1]: {scores}")
    indices = [p["index"] for p in predictions]
    _expect(len(set(indices)) == len(indices), f"repeated class indices: {indices}")
    _expect(all(isinstance(p["label"], str) and p["label"] for p in predictions), "empty label")


# -- users ----------------------------------------------------------------------------------


class ServiceUser(HttpUser):
    """Shared request helper: status and content checks, 429 in a row of its own."""

    abstract = True

    def on_start(self) -> None:
        self.rng = random.Random()
        self.client.headers.update(auth_headers())

    def post_checked(
        self, path: str, name: str, check: Callable[[dict[str, Any]], None], **kwargs: Any
    ) -> dict[str, Any] | None:
        """POST and check; the parsed body on success, None otherwise (already reported)."""
        with self.client.post(path, name=name, catch_response=True, **kwargs) as response:
            if response.status_code == 429:
                response.request_meta["name"] = f"{name} [429]"
                response.success()
                return None
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return None
            try:
                body: dict[str, Any] = response.json()
                check(body)
            except (ValueError, KeyError, TypeError) as exc:  # ContentError is a ValueError
                response.failure(f"bad body: {exc}")
                return None
            response.success()
            return body

    def image_part(self, photo: Photo) -> dict[str, tuple[str, bytes, str]]:
        return {"image": (photo.name, photo.data, "image/jpeg")}

    def image_header(self, photo: Photo) -> dict[str, str]:
        """What a proxy routes by: the photo's image_id."""
        return {"X-Image-Id": photo.sha256}


class AnnotatorUser(ServiceUser):
    """A person annotating: embed once, then 3-8 clicks, each with every point so far."""

    weight = 3
    wait_time = between(0.5, 2.0)  # thinking between clicks and between images

    @task
    def annotate_image(self) -> None:
        photo = self.rng.choice(photos())
        embedded = self.post_checked(
            "/v1/embed",
            "/v1/embed",
            partial(check_embed, photo=photo),
            files=self.image_part(photo),
            headers=self.image_header(photo),
        )
        if embedded is None:
            return
        points: list[list[float]] = []
        labels: list[int] = []
        for click in range(self.rng.randint(3, 8)):
            points.append(random_point(photo, self.rng))
            labels.append(1 if click == 0 else self.rng.choice((1, 1, 0)))
            multimask = click == 0  # one ambiguous point: ask for three candidates
            fields = {
                "image_id": photo.sha256,
                "point_coords": points,
                "point_labels": labels,
                "multimask_output": multimask,
            }
            body = self.post_checked(
                "/v1/segment",
                "/v1/segment [click]",
                partial(
                    check_segment,
                    photo=photo,
                    image_id=photo.sha256,
                    results=1,
                    multimask=multimask,
                ),
                json=fields,
                headers=self.image_header(photo),
            )
            if body is None:
                return
            self.wait()


class BoxSegmentUser(ServiceUser):
    """One-shot segmentation: the image and one to four boxes in one multipart request."""

    weight = 2
    wait_time = between(0.2, 1.0)

    @task
    def segment_boxes(self) -> None:
        photo = self.rng.choice(photos())
        boxes = [random_box(photo, self.rng) for _ in range(self.rng.randint(1, 4))]
        multimask = self.rng.random() < 0.25
        fields = {"boxes": boxes, "multimask_output": multimask}
        self.post_checked(
            "/v1/segment",
            "/v1/segment [boxes]",
            partial(
                check_segment,
                photo=photo,
                image_id=photo.sha256,
                results=len(boxes),
                multimask=multimask,
            ),
            files=self.image_part(photo),
            data={"request": json.dumps(fields)},
            headers=self.image_header(photo),
        )


class ClassifyUser(ServiceUser):
    """Swin classification of a whole photo, top 5."""

    weight = 1
    wait_time = between(0.2, 1.0)

    @task
    def classify(self) -> None:
        photo = self.rng.choice(photos())
        self.post_checked(
            "/v1/classify",
            "/v1/classify",
            partial(check_classify, top_k=TOP_K),
            files=self.image_part(photo),
            data={"request": json.dumps({"top_k": TOP_K})},
            headers=self.image_header(photo),
        )


# -- load profile -------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Stage:
    """Until `end_s` seconds into the run, aim at `users`, spawning `spawn_rate` per second."""

    end_s: float
    users: int
    spawn_rate: float


def parse_stages(text: str) -> list[Stage]:
    """`DURATION:USERS[:SPAWN_RATE],...` (durations 90, 90s, 2m, 1h) -> cumulative stages.

    `ramp` names the built-in profile. Without a rate, a stage gets to its users in ~10 s.
    """
    text = RAMP if text.strip() == "ramp" else text
    stages: list[Stage] = []
    end_s, previous = 0.0, 0
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        match = _DURATION.match(parts[0])
        if len(parts) not in (2, 3) or match is None:
            raise ValueError(f"bad stage {item!r}: want DURATION:USERS[:SPAWN_RATE]")
        end_s += float(match.group(1)) * _UNIT_S[match.group(2)]
        users = int(parts[1])
        rate = float(parts[2]) if len(parts) == 3 else max(1.0, abs(users - previous) / 10)
        if users < 0 or rate <= 0:
            raise ValueError(f"bad stage {item!r}: users >= 0 and spawn rate > 0")
        stages.append(Stage(end_s, users, rate))
        previous = users
    return stages


class RampShape(LoadTestShape):
    """Ramp stages from LOADTEST_STAGES; unset, a flat run of -u users at -r.

    Locust leaves the run time to a shape, so `-t` is enforced here, in both modes.
    """

    use_common_options = True

    def __init__(self) -> None:
        super().__init__()
        self.stages = parse_stages(os.environ.get("LOADTEST_STAGES", ""))

    def _options(self) -> Any:
        return getattr(self.runner.environment, "parsed_options", None) if self.runner else None

    def tick(self) -> tuple[int, float] | None:
        options = self._options()
        run_time = self.get_run_time()
        limit = getattr(options, "run_time", None)
        if limit and run_time >= limit:
            return None
        if not self.stages:
            users = getattr(options, "num_users", None) or 1
            return users, float(getattr(options, "spawn_rate", None) or 1.0)
        for stage in self.stages:
            if run_time < stage.end_s:
                return stage.users, stage.spawn_rate
        return None
