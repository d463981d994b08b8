"""Image sources: `data:` URLs, http(s) URLs and raw bytes to a decoded RGB image, within limits.

Every limit is checked before the expensive step it guards: the byte size before base64
decoding or while downloading (never reading past the limit), the pixel count from the header
before decompressing (a small PNG can inflate to gigabytes). Every failure is an
`InvalidArgumentError` naming the image and the setting, so a bad image is a 400 /
INVALID_ARGUMENT for its own request and nothing else. Decoding is synchronous: callers run it
off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import aiohttp
from PIL import Image

from shared.errors import InvalidArgumentError

FORMATS = ("PNG", "JPEG", "WEBP")
_DATA_MIME = {"image/png", "image/jpeg", "image/jpg", "image/webp"}

ImageSource = str | bytes  # a URL (data: or http(s):) or the image file's bytes


async def load_image_bytes(source: ImageSource, where: str, max_bytes: int, timeout_s: float) -> bytes:
    """The image file's bytes from a URL or as given, at most `max_bytes`."""
    if isinstance(source, bytes):
        _check_bytes(len(source), max_bytes, where)
        return source
    if source.startswith("data:"):
        return _data_url_bytes(source, where, max_bytes)
    if source.startswith(("http://", "https://")):
        return await _fetch(source, where, max_bytes, timeout_s)
    raise InvalidArgumentError(f"{where}: unsupported image URL {source[:40]!r}; use a data: or http(s): URL")


def _check_bytes(num: int, max_bytes: int, where: str) -> None:
    if num > max_bytes:
        raise InvalidArgumentError(f"{where}: the image is larger than {max_bytes} bytes (max_image_bytes)")


def _data_url_bytes(url: str, where: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidArgumentError(f"{where}: malformed data: URL (no comma)")
    params = header.removeprefix("data:").split(";")
    mime = params[0].lower()
    if mime not in _DATA_MIME:
        raise InvalidArgumentError(f"{where}: unsupported image type {mime or 'none'!r}; PNG, JPEG or WebP")
    if "base64" not in params[1:]:
        raise InvalidArgumentError(f"{where}: the data: URL must be base64-encoded (';base64,')")
    _check_bytes(len(payload) * 3 // 4, max_bytes, where)  # before decoding
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgumentError(f"{where}: the data: URL is not valid base64") from exc


async def _fetch(url: str, where: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET the URL, stopping as soon as the body passes `max_bytes`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise InvalidArgumentError(f"{where}: fetching the image URL failed: HTTP {response.status}")
            if response.content_length is not None:
                _check_bytes(response.content_length, max_bytes, where)
            body = bytearray()
            async for chunk in response.content.iter_chunked(64 * 1024):
                body += chunk
                _check_bytes(len(body), max_bytes, where)
            return bytes(body)
    except TimeoutError as exc:
        raise InvalidArgumentError(f"{where}: fetching the image URL timed out after {timeout_s:g} s "
                                   "(max_image_fetch_seconds)") from exc
    except aiohttp.ClientError as exc:
        raise InvalidArgumentError(f"{where}: fetching the image URL failed: {exc}") from exc


def decode_image(data: bytes, where: str, max_pixels: int) -> Image.Image:
    """An RGB image from PNG / JPEG / WebP bytes; the pixel count is checked before decompressing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise InvalidArgumentError(f"{where}: unsupported image format {image.format!r}; PNG, JPEG or WebP")
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidArgumentError(f"{where}: the image has {width}x{height} pixels, more than "
                                           f"{max_pixels} (max_image_pixels)")
            image.load()
            return image.convert("RGB")
    except InvalidArgumentError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidArgumentError(f"{where}: the image could not be decoded (corrupt or truncated): {exc}") from exc
