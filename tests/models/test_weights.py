"""`python -m models.weights` against a real HTTP server on loopback."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

from models.weights import WEIGHTS, WeightsError, WeightsFile, download, main

PAYLOAD = bytes(range(256)) * 4099  # a file of a little over 1 MiB


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A static file server over a folder, like a weights mirror."""
    root = tmp_path / "mirror"
    root.mkdir()
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()


def entry_for(data: bytes, name: str = "model.pth") -> WeightsFile:
    return WeightsFile("test", name, "unused", hashlib.sha256(data).hexdigest(), len(data))


def test_download_verifies_and_lands_atomically(mirror, tmp_path):
    url, root = mirror
    (root / "model.pth").write_bytes(PAYLOAD)
    dest = tmp_path / "weights"
    path = download(entry_for(PAYLOAD), dest, base_url=url)
    assert path == dest / "model.pth" and path.read_bytes() == PAYLOAD
    assert not (dest / "model.pth.part").exists()
    # a second call finds the verified file and does not fetch it again
    (root / "model.pth").unlink()
    assert download(entry_for(PAYLOAD), dest, base_url=url) == path


def test_wrong_bytes_are_refused_and_leave_nothing(mirror, tmp_path):
    url, root = mirror
    (root / "model.pth").write_bytes(PAYLOAD[:-1] + b"\x00")
    dest = tmp_path / "weights"
    with pytest.raises(WeightsError, match="SHA-256"):
        download(replace(entry_for(PAYLOAD), size=None), dest, base_url=url)
    assert list(dest.iterdir()) == []


def test_truncated_download_is_refused(mirror, tmp_path):
    url, root = mirror
    (root / "model.pth").write_bytes(PAYLOAD[:1000])
    with pytest.raises(WeightsError, match="truncated"):
        download(entry_for(PAYLOAD), tmp_path / "w", base_url=url)


def test_missing_file_is_a_clear_error(mirror, tmp_path):
    url, _ = mirror
    with pytest.raises(WeightsError, match="404"):
        download(entry_for(PAYLOAD), tmp_path / "w", base_url=url)


def test_unpublished_hash_needs_consent(mirror, tmp_path):
    url, root = mirror
    (root / "model.pth").write_bytes(PAYLOAD)
    unverified = replace(entry_for(PAYLOAD), sha256=None)
    with pytest.raises(WeightsError, match="allow-unverified"):
        download(unverified, tmp_path / "w", base_url=url)
    assert download(unverified, tmp_path / "w", base_url=url, allow_unverified=True).exists()


def test_cli_list_and_a_mirror_with_the_wrong_file(mirror, tmp_path, capsys):
    url, root = mirror
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "sam_vit_b_01ec64.pth" in listed and WEIGHTS["vit_b"].sha256 in listed
    # a mirror that serves something else under the official name is refused
    (root / "sam_vit_b_01ec64.pth").write_bytes(PAYLOAD)
    code = main(["download", "vit_b", "--dest", str(tmp_path / "w"), "--base-url", url])
    assert code == 1
    assert "expected 375042383" in capsys.readouterr().err
