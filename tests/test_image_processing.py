"""hyla.model.image_processing: parity with transformers' Qwen2VLImageProcessorPil (pixel values, grid, token
count), the patch layout, digests, load_image's sources and refusals, ImageProcessorConfig.from_dir."""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import zlib

import numpy as np
import PIL.Image
import pytest
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_qwen2_vl

from hyla.model.image_processing import (
    ImageProcessorConfig,
    ProcessedImage,
    image_tokens,
    load_image,
    process_image,
    smart_resize,
)

# small pixel bounds so every image stays small: factor 32 -> 4..30 merge blocks; factor 28 -> 4..40
QWEN35 = ImageProcessorConfig(
    patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=4 * 32 * 32, max_pixels=30 * 32 * 32
)
CLIP14 = ImageProcessorConfig(
    patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=4 * 28 * 28, max_pixels=40 * 28 * 28,
    image_mean=tuple(OPENAI_CLIP_MEAN), image_std=tuple(OPENAI_CLIP_STD),
)


def hf_processor(config: ImageProcessorConfig) -> hf_qwen2_vl.Qwen2VLImageProcessorPil:
    return hf_qwen2_vl.Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )


def hf_process(image: PIL.Image.Image, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    out = hf_processor(config)(images=image)
    grid = tuple(int(g) for g in np.asarray(out["image_grid_thw"])[0])
    return np.asarray(out["pixel_values"]), grid


def random_image(rs: np.random.RandomState, mode: str, width: int, height: int) -> PIL.Image.Image:
    """A ``mode`` image of random pixels (a random palette for "P")."""
    bands = {"RGB": 3, "RGBA": 4, "LA": 2, "CMYK": 4, "L": 1, "P": 1}[mode]
    pixels = rs.randint(0, 256, size=(height, width, bands), dtype=np.uint8)
    if bands == 1:
        image = PIL.Image.fromarray(pixels[..., 0], mode="L")
        if mode == "P":
            image = image.convert("P")
            image.putpalette(rs.randint(0, 256, size=768, dtype=np.uint8).tobytes())
        return image
    return PIL.Image.fromarray(pixels, mode=mode)


def png_bytes(image: PIL.Image.Image, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **kwargs)
    return out.getvalue()


def with_transparency(rs: np.random.RandomState) -> PIL.Image.Image:
    """A palette PNG whose palette entry 0 is transparent (``info["transparency"]``, no alpha band)."""
    image = random_image(rs, "P", 45, 38)
    decoded = PIL.Image.open(io.BytesIO(png_bytes(image, transparency=0)))
    decoded.load()
    assert decoded.mode == "P" and decoded.info.get("transparency") == 0
    return decoded


# (mode, width, height): odd sizes, both orientations; 5x7 is below min_pixels (upscaled), 400x310 above
# max_pixels (downscaled)
CASES = [
    ("RGB", 97, 53),
    ("RGB", 53, 97),
    ("RGB", 5, 7),
    ("RGB", 400, 310),
    ("RGBA", 40, 130),
    ("RGBA", 211, 67),
    ("LA", 61, 60),
    ("L", 33, 47),
    ("P", 90, 70),
    ("CMYK", 64, 80),
]


@pytest.mark.parametrize("config", [QWEN35, CLIP14], ids=["patch16", "patch14_clip"])
def test_pixel_values_and_grid_equal_hf(config):
    rs = np.random.RandomState(0)
    images = [random_image(rs, mode, w, h) for mode, w, h in CASES] + [with_transparency(rs)]
    for image in images:
        got = process_image(image, config)
        want, want_grid = hf_process(image, config)
        label = f"{image.mode} {image.size}"
        assert got.grid_thw == want_grid, label
        assert got.pixel_values.dtype == torch.float32, label
        assert tuple(got.pixel_values.shape) == want.shape == (
            math.prod(want_grid), 3 * config.temporal_patch_size * config.patch_size**2
        ), label
        np.testing.assert_allclose(got.pixel_values.numpy(), want, rtol=0, atol=1e-5, err_msg=label)
        assert got.num_tokens == math.prod(want_grid) // config.merge_size**2, label
        assert got.merge_size == config.merge_size


@pytest.mark.parametrize("config", [QWEN35, CLIP14], ids=["patch16", "patch14_clip"])
def test_tiny_images_are_upscaled_and_large_ones_downscaled(config):
    rs = np.random.RandomState(1)
    tiny, large = random_image(rs, "RGB", 5, 7), random_image(rs, "RGB", 400, 310)
    assert 5 * 7 < config.min_pixels and 400 * 310 > config.max_pixels
    for image in (tiny, large):
        got = process_image(image, config)
        _, h, w = got.grid_thw
        area = h * w * config.patch_size**2
        assert config.min_pixels <= area <= config.max_pixels
        assert h % config.merge_size == 0 and w % config.merge_size == 0
        assert hf_process(image, config)[1] == got.grid_thw
    assert process_image(tiny, config).grid_thw[1] > process_image(tiny, config).grid_thw[2]  # 7 tall, 5 wide


def test_patch_layout_and_temporal_repeat():
    """Row r of pixel_values is patch (block row, block col, row in block, col in block) of the normalized
    image, flattened [channel, time, y, x], both time steps the same image."""
    config, p, m = QWEN35, QWEN35.patch_size, QWEN35.merge_size
    image = random_image(np.random.RandomState(2), "RGB", 64, 96)  # already a multiple of 32: no resize
    got = process_image(image, config)
    assert got.grid_thw == (1, 6, 4)
    normalized = (np.asarray(image, dtype=np.float32) / 255 - 0.5) / 0.5  # [H, W, 3]
    rows = got.pixel_values.view(-1, 3, 2, p, p)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])
    blocks_w = 4 // m
    for r in (0, 1, 2, 3, 4, 13, 23):
        block, inner = divmod(r, m * m)
        y = (block // blocks_w * m + inner // m) * p
        x = (block % blocks_w * m + inner % m) * p
        want = normalized[y:y + p, x:x + p].transpose(2, 0, 1)
        np.testing.assert_allclose(rows[r, :, 0].numpy(), want, atol=1e-6, err_msg=f"row {r}")


def test_transparency_is_composited_onto_white():
    """HF does not drop the alpha band: a fully transparent pixel is white (1.0 after normalizing)."""
    pixels = np.zeros((64, 64, 4), dtype=np.uint8)
    pixels[..., 0] = 255  # fully transparent red
    got = process_image(PIL.Image.fromarray(pixels, mode="RGBA"), QWEN35)
    assert torch.equal(got.pixel_values, torch.ones_like(got.pixel_values))
    pixels[..., 3] = 255  # opaque red
    rows = process_image(PIL.Image.fromarray(pixels, mode="RGBA"), QWEN35).pixel_values.view(-1, 3, 2 * 16 * 16)
    assert torch.equal(rows[:, 0], torch.ones_like(rows[:, 0]))
    assert torch.equal(rows[:, 1:], -torch.ones_like(rows[:, 1:]))


def test_num_tokens_equals_hf():
    hf = hf_processor(QWEN35)
    for height, width in [(5, 7), (64, 64), (97, 53), (400, 310), (31, 1000)]:
        want = hf.get_number_of_image_patches(height, width) // QWEN35.merge_size**2
        image = PIL.Image.new("RGB", (width, height))
        assert process_image(image, QWEN35).num_tokens == want, (height, width)


def test_digest_equal_for_equal_images_and_differs_for_one_pixel():
    image = random_image(np.random.RandomState(3), "RGB", 64, 64)  # no resize: every pixel reaches the values
    a, b = process_image(image, QWEN35), process_image(image.copy(), QWEN35)
    assert isinstance(a.digest, bytes) and len(a.digest) == 32
    assert a.digest == b.digest
    from_png = process_image(load_image(png_bytes(image)), QWEN35)
    assert from_png.digest == a.digest
    changed = image.copy()
    r, g, bl = changed.getpixel((10, 20))
    changed.putpixel((10, 20), ((r + 1) % 256, g, bl))
    assert process_image(changed, QWEN35).digest != a.digest
    # the same pixels under another patch layout are another input
    assert process_image(image, CLIP14).digest != a.digest


def test_processed_image_checks_its_fields():
    """A ProcessedImage holds the resized uint8 pixels, its grid theirs; its patches are computed from them."""
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    image = ProcessedImage(pixels, (1, 4, 4), QWEN35, b"")
    assert image.num_tokens == 4 and image.merge_size == 2
    assert torch.equal(image.pixel_values, torch.full((16, 1536), -1.0))  # (0 - 0.5) / 0.5
    for px, grid in [
        (pixels, (1, 4)), (pixels, (1, 4, 3)), (pixels, (1, 8, 8)), (pixels.astype(np.float32), (1, 4, 4)),
        (np.zeros((48, 64, 3), dtype=np.uint8), (1, 3, 4)), (np.zeros((64, 64), dtype=np.uint8), (1, 4, 4)),
    ]:
        with pytest.raises(ValueError):
            ProcessedImage(px, grid, QWEN35, b"")


def test_image_tokens_from_the_size_equal_the_processed_images():
    small = ImageProcessorConfig(patch_size=8, merge_size=2, min_pixels=16 * 16, max_pixels=128 * 128)
    rs = np.random.RandomState(5)
    for _ in range(20):
        height, width = (int(v) for v in rs.randint(8, 700, size=2))
        image = PIL.Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8))
        assert image_tokens(width, height, small) == process_image(image, small).num_tokens


def test_a_size_check_refuses_before_the_pixels_are_decoded():
    seen = []

    def check(width: int, height: int) -> None:
        seen.append((width, height))
        raise ValueError("over budget")

    with pytest.raises(ValueError, match="over budget"):
        load_image(png_declaring(5000, 5000), check_size=check)  # (its pixel data is missing: never read)
    assert seen == [(5000, 5000)]


def test_smart_resize_equals_hf():
    rs = np.random.RandomState(4)
    for _ in range(300):
        height, width = (int(v) for v in rs.randint(1, 3000, size=2))
        if max(height, width) / min(height, width) > 200:
            continue
        factor = int(rs.choice([28, 32]))
        min_pixels = int(rs.randint(1, 200_000))
        max_pixels = min_pixels + int(rs.randint(0, 2_000_000))
        assert smart_resize(height, width, factor, min_pixels, max_pixels) == hf_qwen2_vl.smart_resize(
            height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
        ), (height, width, factor, min_pixels, max_pixels)


def test_aspect_ratio_over_200_is_refused():
    with pytest.raises(ValueError):
        hf_qwen2_vl.smart_resize(1, 201, factor=32)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201, 32, 4096, 30720)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(PIL.Image.new("RGB", (1, 201)), QWEN35)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(PIL.Image.new("RGB", (402, 2)), QWEN35)
    assert smart_resize(1, 200, 32, 4096, 30720) == hf_qwen2_vl.smart_resize(1, 200, 32, 4096, 30720)
    for bad in [(0, 10, 32), (10, 0, 32), (10, 10, 0)]:
        with pytest.raises(ValueError):
            smart_resize(*bad, 1, 100)


def test_process_image_refuses_other_inputs():
    with pytest.raises(ValueError):
        process_image(np.zeros((32, 32, 3), dtype=np.uint8), QWEN35)
    with pytest.raises(ValueError):
        process_image(PIL.Image.new("RGB", (32, 32)), {"patch_size": 16})


# --- load_image ---------------------------------------------------------------------------------------


def test_load_image_sources(tmp_path):
    image = random_image(np.random.RandomState(5), "RGB", 37, 29)
    want = np.asarray(image)
    data = png_bytes(image)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    wrapped = "data:image/png;base64,\n" + "\n".join(url[22 + i:22 + i + 76] for i in range(0, len(url) - 22, 76))
    unpadded = url.rstrip("=")
    for source in (data, bytearray(data), url, wrapped, unpadded, str(path), path, image):
        got = load_image(source)
        assert isinstance(got, PIL.Image.Image) and got.size == (37, 29)
        assert np.array_equal(np.asarray(got), want), type(source)
    assert load_image(image) is image

    jpeg = io.BytesIO()
    image.save(jpeg, "JPEG", quality=95)
    got = load_image(jpeg.getvalue())
    assert got.format == "JPEG" and got.size == (37, 29) and got.mode == "RGB"
    assert np.array_equal(np.asarray(got), np.asarray(PIL.Image.open(io.BytesIO(jpeg.getvalue()))))  # (lossy)
    webp = io.BytesIO()
    image.save(webp, "WEBP", lossless=True)
    assert np.array_equal(np.asarray(load_image(webp.getvalue())), want)


def test_load_image_animated_gif_gives_its_first_frame():
    frames = [PIL.Image.new("L", (20, 10), v).convert("P") for v in (30, 200, 90)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50)
    got = load_image(out.getvalue())
    assert got.size == (20, 10)
    assert not getattr(got, "is_animated", False)
    assert np.array_equal(np.asarray(got.convert("L")), np.full((10, 20), 30, dtype=np.uint8))
    animated = PIL.Image.open(io.BytesIO(out.getvalue()))
    animated.seek(2)
    first = load_image(animated)
    assert np.array_equal(np.asarray(first.convert("L")), np.full((10, 20), 30, dtype=np.uint8))
    assert animated.tell() == 2  # the caller's image is left at its frame


def png_declaring(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR (CRC fixed up) declares ``width x height``: its pixel data is 1x1's, so only a
    size check made from the header, before decoding, can refuse it for its size."""
    data = png_bytes(PIL.Image.new("RGB", (1, 1)))
    assert data[12:16] == b"IHDR"
    ihdr = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:8] + data[8:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def refusals(tmp_path):
    good = png_bytes(PIL.Image.new("RGB", (8, 8), (1, 2, 3)))
    noisy = png_bytes(random_image(np.random.RandomState(8), "RGB", 64, 64))  # its pixel data is most of it
    good_url = "data:image/png;base64," + base64.b64encode(good).decode()
    constant = PIL.Image.new("L", (3000, 3000), 7)
    constant.putpixel((5, 5), 200)
    (tmp_path / "dir").mkdir()
    return [
        ("empty bytes", b"", {}, "empty"),
        ("not an image", b"hello, world: not an image at all", {}, "not an image"),
        ("truncated PNG", noisy[: len(noisy) // 2], {}, "cannot be decoded"),
        ("too many bytes", good, {"max_bytes": len(good) - 1}, "more than the limit"),
        ("data URL too many bytes", good_url, {"max_bytes": len(good) // 2}, "more than the limit"),
        ("bad base64", "data:image/png;base64,iVBORw0K!!!!", {}, "base64"),
        ("base64 of bad length", "data:image/png;base64,iVBORw0KG", {}, "base64"),
        ("non-ASCII base64", "data:image/png;base64,iVBORw0Kgé==", {}, "base64"),
        ("data URL without base64", "data:image/png," + good_url[22:], {}, "base64"),
        ("data URL without comma", "data:image/png;base64", {}, "malformed data URL"),
        ("empty data URL", "data:image/png;base64,", {}, "empty"),
        ("data URL of text", "data:text/plain;base64," + base64.b64encode(b"hi there").decode(), {}, "not an image"),
        ("1x1 with max_pixels 0", good, {"max_pixels": 0}, "more than the limit"),
        ("3000x3000 PNG", png_bytes(constant, compress_level=1), {"max_pixels": 10**6}, "more than the limit"),
        ("header declaring 5000x5000", png_declaring(5000, 5000), {"max_pixels": 10**6}, "more than the limit"),
        ("past PIL's warning, under max_pixels", png_declaring(10_000, 10_000), {"max_pixels": 2**40}, "cannot be decoded"),
        ("past PIL's warning, default max_pixels", png_declaring(10_000, 10_000), {}, "more than the limit"),
        ("PIL's bomb error", png_declaring(20_000, 20_000), {"max_pixels": 2**40}, "too large"),
        ("EPS (not decoded)", b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", {}, "not an image"),
        ("missing file", str(tmp_path / "missing.png"), {}, "no such image file"),
        ("missing path object", tmp_path / "missing.png", {}, "no such image file"),
        ("a directory", tmp_path / "dir", {}, "directory"),
        ("NUL in path", "image\0.png", {}, "NUL"),
        ("http URL", "https://example.com/cat.png", {}, "not fetched"),
        ("zero-size PIL image", PIL.Image.new("RGB", (0, 0)), {}, "empty"),
        ("PIL image too large", PIL.Image.new("RGB", (100, 100)), {"max_pixels": 9999}, "more than the limit"),
        ("another type", 12345, {}, "not int"),
        ("negative max_bytes", good, {"max_bytes": -1}, "max_bytes"),
    ]


def test_load_image_refusals_are_value_errors(tmp_path):
    cases = refusals(tmp_path)
    for name, source, kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            load_image(source, **kwargs)
        assert type(info.value) is ValueError, name
    # the header-only PNGs are what they claim: PIL reads the declared size without decoding
    assert PIL.Image.open(io.BytesIO(png_declaring(5000, 5000))).size == (5000, 5000)


def test_load_image_refuses_files_over_max_bytes(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(png_bytes(PIL.Image.new("RGB", (8, 8))) + b"\0" * 1000)
    with pytest.raises(ValueError, match="more than the limit of 500"):
        load_image(path, max_bytes=500)
    assert load_image(path).size == (8, 8)  # (trailing bytes after IEND are ignored)


def test_loaded_image_is_fully_decoded():
    """A truncated file fails in load_image, not later in process_image."""
    image = random_image(np.random.RandomState(6), "RGB", 64, 64)
    data = png_bytes(image)
    loaded = load_image(data)
    assert loaded.im is not None  # pixels decoded
    with pytest.raises(ValueError):
        load_image(data[:-40])


# --- ImageProcessorConfig ------------------------------------------------------------------------------


def test_config_from_dir_reads_what_hf_saves(tmp_path):
    hf = hf_processor(CLIP14)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())["size"] == {
        "shortest_edge": CLIP14.min_pixels, "longest_edge": CLIP14.max_pixels
    }
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    assert config == CLIP14
    assert config.factor == 28
    image = random_image(np.random.RandomState(7), "RGB", 300, 120)
    reloaded = hf_qwen2_vl.Qwen2VLImageProcessorPil.from_pretrained(tmp_path)(images=image)
    np.testing.assert_allclose(process_image(image, config).pixel_values.numpy(), reloaded["pixel_values"], atol=1e-5)


def test_config_from_dir_legacy_min_max_pixels(tmp_path):
    legacy = {
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "image_processor_type": "Qwen2VLImageProcessor",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(legacy))
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    assert (config.min_pixels, config.max_pixels) == (3136, 12845056)
    assert config.image_mean == tuple(OPENAI_CLIP_MEAN) and config.image_std == tuple(OPENAI_CLIP_STD)
    hf = hf_qwen2_vl.Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    assert (hf.size.shortest_edge, hf.size.longest_edge) == (config.min_pixels, config.max_pixels)
    # legacy keys override size, as in HF
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**legacy, "size": {"shortest_edge": 1, "longest_edge": 2}, "max_pixels": 99_999})
    )
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=14, temporal_patch_size=2, merge_size=2)
    assert (config.min_pixels, config.max_pixels) == (3136, 99_999)


def test_config_from_dir_prefers_processor_config_image_processor(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 10, "longest_edge": 20}}))
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"size": {"shortest_edge": 30, "longest_edge": 40}}, "processor_class": "X"})
    )
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=16, temporal_patch_size=2, merge_size=2)
    assert (config.min_pixels, config.max_pixels) == (30, 40)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "X"}))  # not nested
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=16, temporal_patch_size=2, merge_size=2)
    assert (config.min_pixels, config.max_pixels) == (10, 20)


def test_config_from_dir_without_a_file_is_the_default(tmp_path):
    config = ImageProcessorConfig.from_dir(tmp_path, patch_size=14, temporal_patch_size=3, merge_size=4)
    assert config == ImageProcessorConfig(patch_size=14, temporal_patch_size=3, merge_size=4)
    assert (config.min_pixels, config.max_pixels, config.image_mean) == (65_536, 16_777_216, (0.5, 0.5, 0.5))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"patch_size": 14}', "patch_size is 14"),
        ('{"merge_size": 1}', "merge_size is 1"),
        ('{"temporal_patch_size": 1}', "temporal_patch_size is 1"),
        ('{"patch_size": 16,', "not valid UTF-8 JSON"),
        ("[1, 2]", "JSON object"),
        ('{"patch_size": "16"}', "patch_size must be an integer"),
        ('{"size": [1, 2]}', "size must be an object"),
        ('{"size": {"shortest_edge": 1.5, "longest_edge": 100}}', "min_pixels"),
        ('{"size": {"shortest_edge": 200, "longest_edge": 100}}', "larger than max_pixels"),
        ('{"image_mean": "gray"}', "image_mean"),
        ('{"image_std": [0.5, 0.5]}', "image_std"),
        ('{"image_std": [0.5, 0, 0.5]}', "image_std"),
        ('{"do_normalize": false}', "do_normalize"),
        ('{"rescale_factor": 1.0}', "rescale_factor"),
        ('{"resample": 2}', "resample"),
    ],
)
def test_config_from_dir_refuses(tmp_path, content, message):
    (tmp_path / "preprocessor_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        ImageProcessorConfig.from_dir(tmp_path, patch_size=16, temporal_patch_size=2, merge_size=2)


def test_config_validation():
    assert ImageProcessorConfig(image_mean=[0.1, 0.2, 0.3]).image_mean == (0.1, 0.2, 0.3)
    assert ImageProcessorConfig(image_mean=(0.1, 0.2, 0.3)) == ImageProcessorConfig(image_mean=[0.1, 0.2, 0.3])
    for bad in [
        {"patch_size": 0}, {"merge_size": -2}, {"temporal_patch_size": 1.0}, {"min_pixels": 0}, {"max_pixels": True},
        {"min_pixels": 100, "max_pixels": 99}, {"image_std": (0.5, 0.0, 0.5)}, {"image_mean": (0.5, 0.5)},
        {"image_mean": (0.5, 0.5, float("nan"))}, {"image_std": "abc"},
    ]:
        with pytest.raises(ValueError):
            ImageProcessorConfig(**bad)
    with pytest.raises(ValueError):
        ImageProcessorConfig.from_dir(".", patch_size=0, temporal_patch_size=2, merge_size=2)
