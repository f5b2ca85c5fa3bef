"""The request each kind sends, built at send time from seeded random prompts.

segment   a photo never seen before (the JPEG with a unique comment segment after its SOI
          marker: the same picture in a well-formed file, whose image_id, a hash of the
          bytes, changes, so the embedding cache never hits) with one box: decode, encoder,
          mask decoder, masks
click     1-2 points on an embedding cached beforehand (POST /v1/embed), by image_id, as
          JSON: the interactive-annotation path, mask decoder only. The images clicked on
          are the photos themselves, or `--click-images` copies of them with new bytes
          (`click_copy`), so that clicks spread over that many image_ids, and engines, as
          many annotators' clicks on their own images do
classify  a photo (multipart) with top_k 5: Swin

Every request names its image in X-Image-Id (the SHA-256 of the bytes it sends), as the
service's clients do, so a run through a proxy that hashes it measures that routing.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

KINDS = ("segment", "click", "classify")

# file name, JPEG bytes, width, height: bench.service_load.Photo, not imported from there so
# that client processes start without server.client's imports
Photo = tuple[str, bytes, int, int]
JPEG_EOI = b"\xff\xd9"


@dataclass(frozen=True)
class Request:
    """A POST ready for the wire: the body encoded once, whichever client sends it."""

    path: str
    body: bytes
    headers: dict[str, str]  # Content-Type and X-Image-Id


def multipart(name: str, data: bytes, fields: dict[str, Any], digest: str) -> tuple[bytes, str]:
    """`image` (the file) and `request` (the fields as JSON) as multipart/form-data: the
    body and its Content-Type. The boundary holds half the photo's SHA-256 (`digest`,
    computed once for X-Image-Id too), so the photo's bytes cannot plausibly contain it,
    and stays within RFC 2046's 70 characters (the service's reader refuses longer)."""
    boundary = "openloop" + digest[:32]
    safe = name.replace('"', "_").replace("\r", "_").replace("\n", "_")
    body = b"".join([
        f'--{boundary}\r\nContent-Disposition: form-data; name="request"\r\n\r\n'.encode(),
        json.dumps(fields).encode(),
        f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
        f'filename="{safe}"\r\nContent-Type: image/jpeg\r\n\r\n'.encode(),
        data,
        f"\r\n--{boundary}--\r\n".encode(),
    ])  # fmt: skip
    return body, f"multipart/form-data; boundary={boundary}"


def unique_jpeg(data: bytes, tag: str) -> bytes:
    """The same picture in new bytes: `tag` in a comment (COM) segment right after the SOI
    marker, which decoders skip. The file stays well formed, ending at its EOI as a
    camera's does (a tail after EOI would make it a file the service treats as unusual:
    its frontends then decode it themselves rather than pass it to the GPU's decoder)."""
    if not data.startswith(b"\xff\xd8") or not data.rstrip(b"\x00\r\n ").endswith(JPEG_EOI):
        raise ValueError("not a JPEG ending with its EOI marker")
    text = b"openloop:" + tag.encode()
    return data[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + data[2:]


def click_copy(data: bytes, n: int) -> bytes:
    """Click image n of a photo: its own bytes for n = 0, else the same picture with new
    bytes (`unique_jpeg`), hence another image_id and maybe another engine."""
    return data if n == 0 else unique_jpeg(data, f"click-image-{n}")


def random_box(rng: random.Random, width: int, height: int) -> list[float]:
    """[x0, y0, x1, y1] inside the image, 10-50% of each side."""
    bw, bh = rng.uniform(0.1, 0.5) * width, rng.uniform(0.1, 0.5) * height
    x0, y0 = rng.uniform(0, width - bw), rng.uniform(0, height - bh)
    return [round(x0, 1), round(y0, 1), round(x0 + bw, 1), round(y0 + bh, 1)]


def random_points(
    rng: random.Random, width: int, height: int
) -> tuple[list[list[float]], list[int]]:
    """1 or 2 clicks inside the image: a positive one, maybe followed by either label."""
    n = rng.randint(1, 2)
    coords = [[round(rng.uniform(0, width - 1), 1), round(rng.uniform(0, height - 1), 1)]
              for _ in range(n)]  # fmt: skip
    labels = [1] + [rng.randint(0, 1) for _ in range(n - 1)]
    return coords, labels


class RequestMaker:
    """Builds the next request of a kind for one client process. `nonce` (one per tool run
    and step) and `process` go into every segment photo's tail, so no two requests of any
    run, step or process share bytes, while boxes and points stay seeded."""

    def __init__(
        self,
        images: tuple[Photo, ...],
        image_ids: tuple[str, ...],
        rng: random.Random,
        nonce: str,
        process: int,
    ) -> None:
        """`image_ids`: the click images', each image i a copy of photo `i % len(images)`
        (`click_copy`); none when no click is sent."""
        if not images:
            raise ValueError("no photos")
        if image_ids and len(image_ids) < len(images):
            raise ValueError("an image_id for every photo at least, or none")
        self.images, self.image_ids, self.rng = images, image_ids, rng
        self.nonce, self.process = nonce, process

    def make(self, kind: str, seq: int) -> Request:
        # a click draws among its images (one per photo, as the other kinds draw, by default)
        choices = len(self.image_ids) if kind == "click" and self.image_ids else len(self.images)
        k = self.rng.randrange(choices)
        name, data, width, height = self.images[k % len(self.images)]
        if kind == "segment":
            data = unique_jpeg(data, f"{self.nonce}:{self.process}:{seq}")
            fields: dict[str, Any] = {"box": random_box(self.rng, width, height)}
            return self._multipart("/v1/segment", name, data, fields)
        if kind == "click":
            if not self.image_ids:
                raise ValueError("click needs the photos embedded first")
            coords, labels = random_points(self.rng, width, height)
            image_id = self.image_ids[k]
            body = {"image_id": image_id, "point_coords": coords, "point_labels": labels}
            headers = {"Content-Type": "application/json", "X-Image-Id": image_id}
            return Request("/v1/segment", json.dumps(body).encode(), headers)
        if kind == "classify":
            return self._multipart("/v1/classify", name, data, {"top_k": 5})
        raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")

    @staticmethod
    def _multipart(path: str, name: str, data: bytes, fields: dict[str, Any]) -> Request:
        digest = hashlib.sha256(data).hexdigest()
        body, content_type = multipart(name, data, fields, digest)
        headers = {"Content-Type": content_type, "X-Image-Id": digest}
        return Request(path, body, headers)
