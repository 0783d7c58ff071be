"""Image preprocessing of Qwen3.5 vision-language checkpoints: Qwen2-VL's image processor, in numpy/PIL/torch.

``process_image`` equals transformers' ``Qwen2VLImageProcessorPil`` (the PIL backend; transformers is used by
the tests only): convert to RGB (transparency composited onto white), resize with PIL's bicubic filter to
``smart_resize``'s size (both sides multiples of ``patch_size * merge_size``, the area within
``[min_pixels, max_pixels]``), rescale by 1/255, normalize with ``image_mean`` / ``image_std``, and cut into
patches in HF's order: ``merge_size x merge_size`` blocks of patches, row-major, each patch flattened as
``[channel, time, row, column]`` with the one image repeated ``temporal_patch_size`` times along time.

``load_image`` turns what a request carries (encoded bytes, a data URL, a local path, a PIL image) into a fully
decoded PIL image, refusing with ``ValueError`` what is not one or is too large, before decoding its pixels.

Usage::

    config = ImageProcessorConfig.from_dir(checkpoint, patch_size=16, temporal_patch_size=2, merge_size=2)
    image = process_image(load_image("data:image/png;base64,..."), config)
    image.pixel_values  # [grid_h * grid_w, 3 * 2 * 16 * 16] float32
    image.num_tokens    # grid_h * grid_w // 4 placeholder tokens in the prompt
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import PIL.Image
import torch

from hyla.model.config import read_json

RESCALE_FACTOR = 1 / 255
"""HF's ``rescale_factor``: uint8 pixel values -> [0, 1]."""

RESAMPLE = PIL.Image.Resampling.BICUBIC
"""HF's ``resample`` for Qwen2-VL (``PILImageResampling.BICUBIC``, 3 in a preprocessor_config.json)."""

MAX_IMAGE_BYTES = 20 * 2**20
"""``load_image``'s default limit on an encoded image's size."""

MAX_IMAGE_PIXELS = 2**26
"""``load_image``'s default limit on an image's pixels (checked from its header, before decoding)."""

MAX_ASPECT_RATIO = 200
"""``smart_resize`` refuses an image whose longer side is more than this many times its shorter side."""

IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
"""The PIL formats ``load_image`` decodes (those of them this PIL build has). Others (EPS, which runs
Ghostscript, and PIL's many rarely used readers) are refused as not an image."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """What the image processor needs of a checkpoint's ``preprocessor_config.json``. Sizes in pixels;
    ``min_pixels`` / ``max_pixels`` bound the resized image's area (HF's ``size["shortest_edge"]`` /
    ``size["longest_edge"]``, which despite their names are areas). ``ValueError`` for a non-positive or
    non-integer size, ``min_pixels > max_pixels``, a mean or std that is not 3 finite numbers, a std of 0."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"ImageProcessorConfig.{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"ImageProcessorConfig.min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})"
            )
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if (
                not isinstance(value, (tuple, list))
                or len(value) != 3
                or not all(_is_number(v) and math.isfinite(v) for v in value)
            ):
                raise ValueError(f"ImageProcessorConfig.{name} must be 3 finite numbers, got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if 0.0 in self.image_std:
            raise ValueError(f"ImageProcessorConfig.image_std has a 0: {self.image_std}")

    @property
    def factor(self) -> int:
        """The multiple both sides of a resized image are: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    def overridden(self, kwargs: dict[str, Any] | None, *, capped: bool = False) -> ImageProcessorConfig:
        """This config with ``kwargs`` (vLLM's ``mm_processor_kwargs``: ``min_pixels`` / ``max_pixels``, the
        bounds of a resized image's area, so of its token count) in place of its own; itself for none.
        ``capped`` (a request's, over the server's config): neither may exceed this config's ``max_pixels``, the
        operator's cap on an image's tokens. ``ValueError`` (:func:`check_processor_kwargs`) for another key, a
        value that is not a positive integer, bounds that cross, or (``capped``) a value past the cap."""
        check_processor_kwargs(kwargs)
        if not kwargs:
            return self
        over = [key for key, value in kwargs.items() if capped and value > self.max_pixels]
        if over:
            raise ValueError(f"mm_processor_kwargs: {over[0]} ({kwargs[over[0]]}) is above this engine's max_pixels "
                             f"({self.max_pixels}): a request may lower an image's size, not raise it past that")
        low, high = kwargs.get("min_pixels", self.min_pixels), kwargs.get("max_pixels", self.max_pixels)
        if low > high:
            raise ValueError(f"mm_processor_kwargs: min_pixels ({low}) is above max_pixels ({high}); the "
                             f"checkpoint's are {self.min_pixels} and {self.max_pixels}")
        return dataclasses.replace(self, min_pixels=low, max_pixels=high)

    @classmethod
    def from_dir(
        cls, path: str | os.PathLike, *, patch_size: int, temporal_patch_size: int, merge_size: int
    ) -> ImageProcessorConfig:
        """The image processor config of the checkpoint directory ``path``, read as HF reads it: the
        ``image_processor`` object of ``processor_config.json`` where there is one, else
        ``preprocessor_config.json``; without either, the defaults with the given sizes. Keys as HF writes
        them: ``size`` (``{"shortest_edge", "longest_edge"}``), the legacy ``min_pixels`` / ``max_pixels``
        (which override ``size``, as in HF), ``patch_size``, ``temporal_patch_size``, ``merge_size``,
        ``image_mean``, ``image_std`` (3 numbers, or one for all channels); a null value is the default.

        The keyword arguments are the vision config's sizes, which the file's must equal. ``ValueError`` naming
        the file for a disagreement, a file that is not a JSON object, a key of the wrong type or value, and
        for steps this processor does not run (``do_resize`` / ``do_rescale`` / ``do_normalize`` /
        ``do_convert_rgb`` false, another ``rescale_factor`` or ``resample``)."""
        vision = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size}
        for key, value in vision.items():
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        found = _read_processor_dict(Path(path))
        if found is None:
            return cls(**vision)
        file, raw = found
        try:
            return cls(**_parse_processor_dict(raw, vision))
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None


PROCESSOR_KWARGS = ("min_pixels", "max_pixels")
"""What ``mm_processor_kwargs`` may override (:meth:`ImageProcessorConfig.overridden`)."""


def check_processor_kwargs(kwargs: Any) -> None:
    """``ValueError`` unless ``kwargs`` is None or a dict of :data:`PROCESSOR_KWARGS` keys to positive integers
    (at most ``MAX_IMAGE_PIXELS``), ``min_pixels <= max_pixels`` where both are given."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs must be an object, got {kwargs!r}")
    for key, value in kwargs.items():
        if key not in PROCESSOR_KWARGS:
            raise ValueError(f"mm_processor_kwargs: {key!r} is not an image preprocessing option hyla takes "
                             f"(only {', '.join(PROCESSOR_KWARGS)})")
        if not _is_int(value) or not 0 < value <= MAX_IMAGE_PIXELS:
            raise ValueError(f"mm_processor_kwargs: {key} must be an integer in [1, {MAX_IMAGE_PIXELS}], got {value!r}")
    if kwargs.get("min_pixels", 0) > kwargs.get("max_pixels", MAX_IMAGE_PIXELS):
        raise ValueError(f"mm_processor_kwargs: min_pixels ({kwargs['min_pixels']}) is above max_pixels "
                         f"({kwargs['max_pixels']})")


def _read_processor_dict(path: Path) -> tuple[Path, dict[str, Any]] | None:
    """(file, the image processor's dict) of the checkpoint directory ``path``, or ``None`` without one;
    ``ValueError`` for a file that cannot be read or is not JSON holding an object."""
    nested = path / "processor_config.json"
    if nested.is_file():
        content = _json_object(nested)
        if "image_processor" in content:
            if not isinstance(content["image_processor"], dict):
                raise ValueError(f"{nested}: image_processor is not a JSON object")
            return nested, content["image_processor"]
    single = path / "preprocessor_config.json"
    if single.is_file():
        return single, _json_object(single)
    return None


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ``ValueError`` naming it for anything else."""
    content = read_json(file)
    if not isinstance(content, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    return content


def _parse_processor_dict(raw: dict[str, Any], vision: dict[str, int]) -> dict[str, Any]:
    """``ImageProcessorConfig`` keyword arguments from an HF image processor dict; ``ValueError`` for what
    does not fit (see ``ImageProcessorConfig.from_dir``)."""
    kwargs: dict[str, Any] = {}
    for key, want in vision.items():
        got = raw.get(key)
        if got is None:
            got = want
        elif not _is_int(got):
            raise ValueError(f"{key} must be an integer, got {got!r}")
        elif got != want:
            raise ValueError(f"{key} is {got} but the vision config's is {want}")
        kwargs[key] = got

    size = raw.get("size")
    if size is None:
        size = {}
    if not isinstance(size, dict):
        raise ValueError(f"size must be an object with shortest_edge and longest_edge, got {size!r}")
    bounds = {
        "min_pixels": _first_present(raw.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")),
        "max_pixels": _first_present(raw.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")),
    }
    for key, value in bounds.items():
        if value is None:
            continue
        if not _is_int(value):
            raise ValueError(f"{key} (size) must be an integer, got {value!r}")
        kwargs[key] = value

    for key in ("image_mean", "image_std"):
        value = raw.get(key)
        if value is None:
            continue
        if _is_number(value):
            value = (value,) * 3
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key} must be a list of 3 numbers, got {value!r}")
        kwargs[key] = tuple(value)

    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        value = raw.get(key)
        if value is not None and value is not True:
            raise ValueError(f"{key}={value!r} is not supported (hyla's image processor always runs this step)")
    rescale = raw.get("rescale_factor")
    if rescale is not None and (not _is_number(rescale) or not math.isclose(rescale, RESCALE_FACTOR, rel_tol=1e-9)):
        raise ValueError(f"rescale_factor={rescale!r} is not supported (only 1/255)")
    resample = raw.get("resample")
    if resample is not None and resample != int(RESAMPLE):
        raise ValueError(f"resample={resample!r} is not supported (only bicubic, {int(RESAMPLE)})")
    return kwargs


def _first_present(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image, ready for the vision encoder: its resized RGB ``pixels`` (uint8 ``[H, W, 3]``, sides multiples
    of ``config.factor``), kept as they are, a quarter of the size of the floats they become (and an eighth of
    the patches, which repeat each value ``temporal_patch_size`` times); ``pixel_values`` computes the patches
    when the encoder needs them.

    ``grid_thw``: ``(1, grid_h, grid_w)`` in patches; ``digest``: sha256 over the config, the grid and the
    pixels, so equal images (under one config) have equal digests. Compared by identity (``pixels`` is an
    array); compare ``digest``. ``ValueError`` for pixels that are not such an array, or a grid that is not theirs."""

    pixels: np.ndarray
    grid_thw: tuple[int, int, int]
    config: ImageProcessorConfig
    digest: bytes

    def __post_init__(self) -> None:
        px, c = self.pixels, self.config
        if not isinstance(c, ImageProcessorConfig):
            raise ValueError(f"config must be an ImageProcessorConfig, got {type(c).__name__}")
        if not isinstance(px, np.ndarray) or px.dtype != np.uint8 or px.ndim != 3 or px.shape[2] != 3:
            raise ValueError("pixels must be a uint8 [H, W, 3] array")
        if px.shape[0] % c.factor or px.shape[1] % c.factor or not px.shape[0] or not px.shape[1]:
            raise ValueError(f"pixels of {px.shape[0]}x{px.shape[1]} are not a multiple of {c.factor} on each side")
        grid = tuple(self.grid_thw)
        if grid != (1, px.shape[0] // c.patch_size, px.shape[1] // c.patch_size):
            raise ValueError(f"grid_thw {self.grid_thw!r} is not the pixels' (1, {px.shape[0] // c.patch_size}, "
                             f"{px.shape[1] // c.patch_size})")
        object.__setattr__(self, "grid_thw", tuple(int(g) for g in grid))

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    @property
    def num_tokens(self) -> int:
        """The placeholder tokens the image fills in the prompt: ``t * h * w // merge_size**2``."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2

    @property
    def pixel_values(self) -> torch.Tensor:
        """``[grid_t * grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` float32: one row per patch in
        HF's layout (the module's docstring), computed anew from ``pixels`` at each call."""
        c = self.config
        # HF's order of float operations: uint8 -> float64 * (1/255) -> float32, then (x - mean) / std in float32
        scaled = (self.pixels.astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
        mean = np.asarray(c.image_mean, dtype=np.float32)
        std = np.asarray(c.image_std, dtype=np.float32)
        normalized = np.moveaxis((scaled - mean) / std, -1, 0)  # [3, H, W]
        patches, _, _ = _patchify(normalized, c.patch_size, c.merge_size, c.temporal_patch_size)
        return torch.from_numpy(patches)


def image_tokens(width: int, height: int, config: ImageProcessorConfig) -> int:
    """The placeholder tokens an image of ``width x height`` pixels fills once processed (``smart_resize``'s size
    in merged patches): known from its header, before its pixels are decoded. ``ValueError`` as ``smart_resize``."""
    h, w = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return (h // config.factor) * (w // config.factor)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """HF's ``smart_resize``: the ``(height, width)`` an image of ``height x width`` pixels is resized to. Both
    are multiples of ``factor``, each side the nearest multiple; if that area exceeds ``max_pixels`` both shrink
    by one scale (rounded down, at least ``factor``), if it is below ``min_pixels`` both grow (rounded up), so
    the aspect ratio is kept as nearly as multiples allow. ``ValueError`` for an aspect ratio over 200 (as HF),
    and for a non-positive side or factor."""
    for name, value in (("height", height), ("width", width), ("factor", factor)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"smart_resize: {name} must be a positive integer, got {value!r}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width)} ({width}x{height} pixels)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` in mode RGB as HF converts it: an image with an alpha band, or a ``transparency`` entry in its
    info (a palette or grayscale PNG / GIF with a transparent colour), is composited onto white; any other is
    ``image.convert("RGB")``."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def process_image(image: PIL.Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """``image`` as the vision encoder's input, equal to HF's ``Qwen2VLImageProcessorPil`` with the same
    config: RGB (``to_rgb``), resized with PIL's bicubic filter to ``smart_resize``'s size, rescaled by 1/255,
    normalized, cut into patches (``ProcessedImage`` has the shapes). ``ValueError`` for something other than a
    PIL image, an empty image, an aspect ratio over 200."""
    if not isinstance(image, PIL.Image.Image):
        raise ValueError(f"process_image needs a PIL image, got {type(image).__name__}")
    if not isinstance(config, ImageProcessorConfig):
        raise ValueError(f"process_image needs an ImageProcessorConfig, got {type(config).__name__}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is empty ({width}x{height} pixels)")
    new_height, new_width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    resized = to_rgb(image).resize((new_width, new_height), resample=RESAMPLE)
    pixels = np.ascontiguousarray(np.asarray(resized, dtype=np.uint8))  # [H, W, 3]
    grid = (1, new_height // config.patch_size, new_width // config.patch_size)
    return ProcessedImage(pixels=pixels, grid_thw=grid, config=config, digest=_digest(grid, config, pixels))


def _patchify(
    image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, int, int]:
    """``image`` ``[C, H, W]`` (sides multiples of ``patch_size * merge_size``) -> (``[grid_h * grid_w,
    C * temporal_patch_size * patch_size**2]`` float32, a fresh contiguous array; grid_h; grid_w): rows in
    merge-block order, each row ``[C, T, patch_size, patch_size]`` flattened with the image repeated T times."""
    channels, height, width = image.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = image.reshape(
        channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size
    ).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh, gw, mh, mw, C, ph, pw]
    patches = np.broadcast_to(
        patches[:, :, :, :, :, None], (*patches.shape[:5], temporal_patch_size, *patches.shape[5:])
    )
    flat = np.ascontiguousarray(patches.reshape(grid_h * grid_w, channels * temporal_patch_size * patch_size**2))
    return flat.astype(np.float32, copy=False), grid_h, grid_w


def _digest(grid: tuple[int, int, int], config: ImageProcessorConfig, pixels: np.ndarray) -> bytes:
    """sha256 over the config's fields, the grid and the resized pixels' bytes."""
    h = hashlib.sha256(b"hyla.image.v2")
    h.update(repr((config.patch_size, config.temporal_patch_size, config.merge_size, config.image_mean,
                   config.image_std)).encode())
    h.update(np.asarray(grid, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes())
    return h.digest()


def load_image(source: Any, *, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS,
               check_size: Callable[[int, int], None] | None = None) -> PIL.Image.Image:
    """A request's image, decoded. ``source``: a ``PIL.Image.Image``; ``bytes`` / ``bytearray`` holding an
    encoded file (PNG, JPEG, WebP, GIF, BMP, TIFF, AVIF: ``IMAGE_FORMATS``); a ``str`` data URL
    (``data:image/png;base64,...``; base64 only, padding optional, whitespace ignored); an ``os.PathLike``
    or other ``str`` naming a local file. Returns the image with its pixels loaded (``img.load()``), so no
    error surfaces later; for an animated image (GIF, APNG, WebP...) a copy of its first frame.

    ``ValueError`` with a message saying which, for: an empty encoding or one of more than ``max_bytes``
    bytes, a malformed data URL or base64, an http(s) URL (not fetched here), a file that does not exist or
    cannot be read, bytes that are not an image of ``IMAGE_FORMATS`` (or are truncated or corrupt), an
    image of no pixels or of more than ``max_pixels`` (checked from the header before its pixels are
    decoded; PIL's own decompression-bomb warning and error become this ``ValueError`` too), a source of
    another type, negative limits. ``check_size(width, height)``, called from the header too, before the
    pixels are decoded, may refuse the image with its own ``ValueError`` (a budget of tokens)."""
    image = open_image(source, max_bytes=max_bytes, max_pixels=max_pixels)
    if check_size is not None:
        check_size(*image.size)
    return _loaded(image)


def open_image(source: Any, *, max_bytes: int = MAX_IMAGE_BYTES,
               max_pixels: int = MAX_IMAGE_PIXELS) -> PIL.Image.Image:
    """:func:`load_image`'s image before its pixels are decoded: its header read and its size checked (its
    ``size`` is what an image's tokens follow from: :func:`image_tokens`). ``ValueError`` as ``load_image``,
    but for pixel data that is truncated or corrupt, which only decoding finds."""
    if not _is_int(max_bytes) or max_bytes < 0:
        raise ValueError(f"max_bytes must be a non-negative integer, got {max_bytes!r}")
    if not _is_int(max_pixels) or max_pixels < 0:
        raise ValueError(f"max_pixels must be a non-negative integer, got {max_pixels!r}")
    if isinstance(source, PIL.Image.Image):
        return _checked_size(source, max_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        data = _data_url_bytes(source, max_bytes)
    elif isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise ValueError(f"image URLs are not fetched; send the image as a data URL ({_short(source)})")
    elif isinstance(source, (str, os.PathLike)):
        data = _file_bytes(source, max_bytes)
    else:
        raise ValueError(f"an image must be a PIL image, bytes, a data URL or a file path, not {type(source).__name__}")
    if not data:
        raise ValueError("the image is empty (0 bytes)")
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data)} bytes, more than the limit of {max_bytes}")
    return _checked_size(_open(data), max_pixels)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes a base64 data URL holds; ``ValueError`` for a malformed one, or one holding more than
    ``max_bytes`` bytes (judged from its length before decoding)."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ValueError(f"malformed data URL: no ',' after the media type ({_short(url)})")
    params = [p.strip().lower() for p in header.split(";")]
    if "base64" not in params[1:]:
        raise ValueError(f"only base64 data URLs are supported (data:<type>;base64,...), got {_short(url)}")
    payload = "".join(payload.split())  # (line breaks and spaces some clients insert)
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ValueError(f"the data URL holds about {len(payload) // 4 * 3} bytes, more than the limit of {max_bytes}")
    payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:  # (bad characters or length; non-ASCII text)
        raise ValueError(f"the data URL's base64 is malformed ({exc})") from None


def _file_bytes(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of the local file ``path``; ``ValueError`` for a missing or unreadable file, one of more
    than ``max_bytes`` bytes (judged by its size before reading)."""
    try:
        name = os.fspath(path)
    except TypeError as exc:
        raise ValueError(f"not a usable image path: {exc}") from None
    shown = _short(os.fsdecode(name), 200)
    if ("\0" if isinstance(name, str) else b"\0") in name:
        raise ValueError(f"the image path has a NUL character: {shown}")
    try:
        with open(name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(max_bytes + 1) if size <= max_bytes else None
    except FileNotFoundError:
        raise ValueError(f"no such image file: {shown}") from None
    except IsADirectoryError:
        raise ValueError(f"the image path is a directory: {shown}") from None
    except OSError as exc:
        raise ValueError(f"cannot read the image file {shown} ({exc.strerror or exc})") from None
    if data is None:
        raise ValueError(f"the image file {shown} is {size} bytes, more than the limit of {max_bytes}")
    return data


def _image_formats() -> list[str]:
    PIL.Image.init()  # (registers PIL's plugins; idempotent)
    return [f for f in IMAGE_FORMATS if f in PIL.Image.OPEN]


def _open(data: bytes) -> PIL.Image.Image:
    """The image encoded in ``data``, its header read (its pixels not decoded). (PIL's decompression-bomb check
    at ``open`` raises past twice its own limit, and only warns below that: ``max_pixels`` refuses those. No
    warning filter is touched: the filters are process-wide, and images are decoded on several threads at
    once.)"""
    try:
        return PIL.Image.open(io.BytesIO(data), formats=_image_formats())
    except PIL.Image.DecompressionBombError as exc:
        raise ValueError(f"the image is too large: {exc}") from None
    except PIL.UnidentifiedImageError:
        raise ValueError(
            f"the data is not an image of a supported format ({', '.join(IMAGE_FORMATS)}); "
            f"it begins {data[:16]!r}"
        ) from None
    except Exception as exc:  # (PIL's readers raise many types for malformed headers)
        raise ValueError(f"the image cannot be decoded ({type(exc).__name__}: {exc})") from None


def _checked_size(image: PIL.Image.Image, max_pixels: int) -> PIL.Image.Image:
    """``image``, refused for no pixels or more than ``max_pixels``."""
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"the image is empty ({width}x{height} pixels)")
    if width * height > max_pixels:
        raise ValueError(
            f"the image is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}"
        )
    return image


def _loaded(image: PIL.Image.Image) -> PIL.Image.Image:
    """``image`` with its pixels decoded; its first frame (a copy) where it is animated."""
    try:
        if getattr(image, "is_animated", False):  # (not n_frames: that decodes every frame of a GIF)
            position = image.tell()
            if position != 0:
                image.seek(0)
            image.load()
            frame = image.copy()
            if position != 0:
                image.seek(position)
            return frame
        image.load()
    except Exception as exc:  # (truncated or corrupt pixel data: OSError, SyntaxError, ...)
        raise ValueError(f"the image cannot be decoded ({type(exc).__name__}: {exc})") from None
    return image
