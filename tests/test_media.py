"""Images from requests: data URLs, local files only under the allowed folder, the network only for named hosts
(never by default), the pixel cap checked from the header before decoding, and corrupt bytes refused by name."""

import base64
import http.server
import io
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lockstep.multimodal.media import MediaError, MediaPolicy, decode_image, load_image


def png_bytes(width: int = 5, height: int = 3, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels and whose data is a few bytes: decoding it would need
    width * height * 3 bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


POLICY = MediaPolicy()


def test_a_data_url_decodes_to_the_same_pixels() -> None:
    data = png_bytes(7, 4)
    image = load_image(data_url(data), POLICY)
    assert image.size == (7, 4)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(b"not an image at all"), "could not be read as an image"),
        (data_url(png_bytes(64, 64)[:-200]), "corrupt or truncated"),
        ("data:image/png;base64,@@@not base64@@@", "base64"),
        ("data:text/plain;base64,aGVsbG8=", "data:image/png;base64"),
        ("ftp://example.com/cat.png", "unsupported image URL"),
        ("cat.png", "unsupported image URL"),
    ],
)
def test_bad_image_data_is_refused_by_name(url: str, words: str) -> None:
    with pytest.raises(MediaError, match=words):
        load_image(url, POLICY)


def test_the_pixel_cap_is_checked_before_decoding() -> None:
    bomb = bomb_png(50_000, 50_000)  # 2.5 G pixels (7.5 GB as RGB) in under 100 bytes
    assert len(bomb) < 100
    with pytest.raises(MediaError, match="pixels"):
        decode_image(bomb, POLICY)
    # Under PIL's own bomb limit, over lockstep's default (8192 x 8192): refused from the header too.
    with pytest.raises(MediaError, match=r"9000x9000 = 81000000 pixels; at most 67108864"):
        decode_image(bomb_png(9000, 9000), POLICY)
    small = MediaPolicy(max_image_pixels=100)
    with pytest.raises(MediaError, match=r"11x10 = 110 pixels; at most 100"):
        decode_image(png_bytes(11, 10), small)
    assert decode_image(png_bytes(10, 10), small).size == (10, 10)


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "cat.png").write_bytes(png_bytes(3, 2))
    (tmp_path / "secret.png").write_bytes(png_bytes(3, 2))
    url = (inside / "cat.png").as_uri()
    with pytest.raises(MediaError, match="allowed_local_media_path"):
        load_image(url, POLICY)
    policy = MediaPolicy(allowed_local_media_path=str(inside))
    assert load_image(url, policy).size == (3, 2)
    escape = inside.as_uri() + "/../secret.png"
    with pytest.raises(MediaError, match="outside the allowed folder"):
        load_image(escape, policy)
    with pytest.raises(MediaError, match="no image file"):
        load_image((inside / "dog.png").as_uri(), policy)


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://example.com/x.png")
            self.end_headers()
            return
        body = png_bytes(4, 4)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_the_network_only_for_named_hosts() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/cat.png"
        with pytest.raises(MediaError, match="--allowed-media-domains"):
            load_image(url, POLICY)  # by default nothing is fetched
        policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
        assert load_image(url, policy).size == (4, 4)
        with pytest.raises(MediaError, match="redirect"):
            load_image(f"http://127.0.0.1:{server.server_port}/redirect", policy)
    finally:
        server.shutdown()
