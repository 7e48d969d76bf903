"""Images from what a request sends: PIL images, data URLs, local files under an allowed folder and, only from
hosts named in advance, http(s) URLs.

Nothing reaches the network unless ``allowed_media_domains`` names the host (then without following redirects,
with a time limit and a size cap), and nothing on disk is read outside ``allowed_local_media_path``. Every image is
checked for its pixel count from its header before it is decoded, so a small file that would decode to gigabytes
is refused for what it costs to read the header. Every failure is a ``MediaError`` (a ValueError) that says what
was wrong: the server answers it with 400.
"""

import base64
import binascii
import io
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

MAX_FETCHED_BYTES = 32 << 20  # an image fetched over http(s)
FETCH_TIMEOUT = 10.0  # seconds


class MediaError(ValueError):
    """An image that cannot be used, with the reason."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be (``EngineConfig``'s fields of the same names)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_pixels: int = 8192 * 8192


def load_image(source: object, policy: MediaPolicy) -> Image.Image:
    """A decoded image from a PIL image, a ``data:image/...;base64,`` URL, a ``file://`` URL (under
    ``allowed_local_media_path``) or an ``http(s)://`` URL (of a host in ``allowed_media_domains``)."""
    if isinstance(source, Image.Image):
        _check_pixels(source, policy)
        return source
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image or a URL string, got {type(source).__name__}")
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(source), policy)
    if scheme == "file":
        return decode_image(_local_file_bytes(source, policy), policy)
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, policy), policy)
    shown = source[:40] + ("..." if len(source) > 40 else "")
    raise MediaError(f"unsupported image URL {shown!r}: send a data:image/...;base64, URL (or file:// or http(s)://)")


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Decode image file bytes, refusing more than ``policy.max_image_pixels`` pixels before decoding them."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as e:
        raise MediaError(f"the image is too large to decode: {e}") from None
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError, ...
        raise MediaError(f"the image data could not be read as an image ({type(e).__name__}: {e})") from None
    _check_pixels(image, policy)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
    except Exception as e:  # truncated or corrupt data past the header
        raise MediaError(f"the image data is corrupt or truncated ({type(e).__name__}: {e})") from None
    return image


def _check_pixels(image: Image.Image, policy: MediaPolicy) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise MediaError(f"the image has no pixels ({width}x{height})")
    if width * height > policy.max_image_pixels:
        raise MediaError(
            f"the image is {width}x{height} = {width * height} pixels; at most {policy.max_image_pixels} are "
            "decoded (max_image_pixels)"
        )


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise MediaError("a data URL image must look like data:image/png;base64,<base64 data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL's base64 payload is invalid: {e}") from None


def _local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaError(
            "local image files are read only under an allowed folder: set allowed_local_media_path "
            "(serve --allowed-local-media-path)"
        )
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"a file:// URL names a file on this machine, not on {parsed.netloc!r}")
    path = Path(urllib.parse.unquote(parsed.path)).resolve()
    root = Path(policy.allowed_local_media_path).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"the image file is outside the allowed folder {str(root)!r} (allowed_local_media_path)")
    if not path.is_file():
        raise MediaError(f"no image file at {str(path)!r}")
    return path.read_bytes()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise MediaError(f"the image URL redirects (HTTP {code}); redirects are not followed")


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    host = urllib.parse.urlparse(url).hostname or ""
    if host.lower() not in {d.lower() for d in policy.allowed_media_domains}:
        raise MediaError(
            f"fetching images from the network is off for {host!r}: the server fetches only from hosts named with "
            "--allowed-media-domains (LLM: allowed_media_domains); send the image as a data:image/...;base64, URL"
        )
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(url, timeout=FETCH_TIMEOUT) as response:
            data = response.read(MAX_FETCHED_BYTES + 1)
    except MediaError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MediaError(f"could not fetch the image from {host!r}: {e}") from None
    if len(data) > MAX_FETCHED_BYTES:
        raise MediaError(f"the image at {host!r} is larger than {MAX_FETCHED_BYTES} bytes")
    return data
