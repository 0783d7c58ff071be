"""What an image in a prompt costs, and what the prefix cache saves of it (a Qwen3.5 vision-language model).

The model: issue 10's Qwen3.5 text model (``gpu_decode.py``'s FULL; ``--tiny``: TINY) with a vision tower of
``VISION``'s shape (depth 12, width 768, 12 heads, MLP 3,072, 16-pixel patches merged 2 x 2; random weights), in
a ``Qwen3_5ForConditionalGeneration`` checkpoint built here with transformers. Each measurement is a median of
``--repeats`` rounds after a warm-up round, against its peer in the same run:

* **preprocessing** one ``--size`` x ``--size`` PNG (decode, resize, normalise, patches): hyla's
  ``process_image(load_image(png))`` against transformers' ``Qwen2VLImageProcessorPil``;
* **the vision tower** on its patches: hyla's ``VisionTower`` against transformers' ``Qwen3_5VisionModel``
  (the same weights);
* **TTFT** of a turn with the image (``max_new_tokens`` 1, through ``Engine.generate``): *cold*, a new image
  each round (preprocessing, tower, prefill), against transformers' forward of the same prompt (its prefill
  alone); and *cached*, the same image again with another question after it: the cache serves the system
  prompt and the image (the state after the image kept as a chat's message end is), so the tower does not
  run. The cached/cold ratio is what the cache saves. And *embedded*: the same image after another system
  prompt, where the prefix cache serves nothing: the embedding cache (``mm_embedding_cache_mb``) serves the tower's
  output, so the turn pays preprocessing and prefill alone.

Writes the ``## Images in prompts`` section of docs/benchmarks.md.

    .venv/bin/python benchmarks/images.py [--repeats 3]
    .venv/bin/python benchmarks/images.py --tiny --repeats 1 --size 64 --no-write   # smoke
"""

from __future__ import annotations

import argparse
import io
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402

from benchmarks.gpu_decode import FULL, TINY  # noqa: E402
from benchmarks.report import machine, write_section  # noqa: E402
from hyla import Engine  # noqa: E402
from hyla.model.image_processing import ImageProcessorConfig, load_image, process_image  # noqa: E402

SECTION = "Images in prompts"
VISION = dict(depth=12, hidden_size=768, num_heads=12, intermediate_size=3072, patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")
TINY_VISION = dict(VISION, depth=2, hidden_size=64, num_heads=4, intermediate_size=128, num_position_embeddings=64)
PIXELS = {"min_pixels": 32 * 32, "max_pixels": 1024 * 1024}


def build(out: Path, tiny: bool) -> dict[str, int]:
    """The checkpoint (transformers' random initialisation, seeded) with a preprocessor_config.json; its image
    token ids, at the vocabulary's end."""
    import json

    import transformers

    text = dict(TINY if tiny else FULL)
    vocab = text["vocab_size"]
    tokens = dict(vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3, image_token_id=vocab - 2,
                  video_token_id=vocab - 1)
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": _sections(text), "mrope_interleaved": True}
    vision = dict(TINY_VISION if tiny else VISION, out_hidden_size=text["hidden_size"])
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision,
                                        tie_word_embeddings=text["tie_word_embeddings"], **tokens)
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).eval().save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": vision["patch_size"], "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "size": {"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]}}))
    return tokens


def _sections(text: dict) -> list[int]:
    """An interleaved mrope_section for the text model's rotary (Qwen3.5's 11/11/10 of 32 frequencies, scaled)."""
    freqs = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    h = freqs * 11 // 32
    return [freqs - 2 * h, h, h]


def png(seed: int, size: int) -> bytes:
    """A random photo-like image (smooth noise), PNG-encoded."""
    rng = np.random.RandomState(seed)
    small = rng.randint(0, 256, (size // 8 + 1, size // 8 + 1, 3), dtype=np.uint8)
    image = PIL.Image.fromarray(small).resize((size, size), PIL.Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="gpu_decode.py's TINY text model and a 2-block tower (smoke)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", type=int, default=448, help="the image's side in pixels")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        tokens = build(path, args.tiny)
        patch = (TINY_VISION if args.tiny else VISION)["patch_size"]
        config = ImageProcessorConfig.from_dir(path, patch_size=patch, temporal_patch_size=2, merge_size=2)
        peer_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                                  image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                  size={"shortest_edge": PIXELS["min_pixels"],
                                                        "longest_edge": PIXELS["max_pixels"]})
        hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        engine = Engine(str(path), max_running_requests=4, warmup="off", cpu_threads=args.threads)
        vs, img, ve = tokens["vision_start_token_id"], tokens["image_token_id"], tokens["vision_end_token_id"]
        rng = np.random.RandomState(1)
        vocab = engine.model_config.vocab_size - 4
        system = rng.randint(10, vocab, 24).tolist()
        turn = lambda question: system + [vs, img, ve] + question  # noqa: E731
        results: dict[str, list[float]] = {k: [] for k in ("prep", "prep_peer", "tower", "tower_peer", "cold",
                                                           "cold_peer", "cached", "embedded")}
        num_tokens = 0
        try:
            for rnd in range(1 + args.repeats):
                data = png(100 + rnd, args.size)
                image = process_image(load_image(data), config)
                num_tokens = image.num_tokens
                # (to the patches, as transformers' processor gives them: hyla computes them from the pixels it keeps)
                prep = timed(lambda: process_image(load_image(data), config).pixel_values)
                prep_peer = timed(lambda: peer_processor(images=[PIL.Image.open(io.BytesIO(data))],
                                                         return_tensors="pt"))
                grid, patches = [image.grid_thw], image.pixel_values
                with torch.no_grad():
                    tower = timed(lambda: engine.model.visual(patches, grid))
                    tower_peer = timed(lambda: hf.model.visual(patches, grid_thw=torch.tensor(grid)))
                first = turn(rng.randint(10, vocab, 12).tolist())
                after_image = len(system) + 3  # (a chat's message end: its state kept)
                cold = timed(lambda: engine.generate(input_ids=first, image_data=[data], checkpoints=[after_image],
                                                     sampling_params={"max_new_tokens": 1}))
                ids = first[:len(system) + 1] + [img] * num_tokens + first[len(system) + 2:]
                input_ids = torch.tensor([ids])
                with torch.no_grad():
                    cold_peer = timed(lambda: hf(input_ids=input_ids, pixel_values=image.pixel_values,
                                                 image_grid_thw=torch.tensor(grid),
                                                 mm_token_type_ids=(input_ids == img).int(), logits_to_keep=1))
                second = turn(rng.randint(10, vocab, 12).tolist())
                out = {}
                cached = timed(lambda: out.update(engine.generate(input_ids=second, image_data=[data],
                                                                  sampling_params={"max_new_tokens": 1})))
                hit = out["meta_info"]["cached_tokens"]
                assert hit >= len(system) + 2 + num_tokens, f"the image was not served from the cache ({hit} tokens)"
                third = rng.randint(10, vocab, 24).tolist() + [vs, img, ve] + rng.randint(10, vocab, 12).tolist()
                hits = engine.get_stats()["num_image_cache_hits"]
                embedded = timed(lambda: out.update(engine.generate(input_ids=third, image_data=[data],
                                                                    sampling_params={"max_new_tokens": 1})))
                assert out["meta_info"]["cached_tokens"] == 0 and engine.get_stats()["num_image_cache_hits"] == hits + 1
                row = dict(prep=prep, prep_peer=prep_peer, tower=tower, tower_peer=tower_peer, cold=cold,
                           cold_peer=cold_peer, cached=cached, embedded=embedded)
                print(f"round {rnd}{' (warm-up)' if rnd == 0 else ''}: " +
                      ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items()), flush=True)
                if rnd:
                    for k, v in row.items():
                        results[k].append(v)
        finally:
            engine.shutdown()
    med = {k: statistics.median(v) * 1e3 for k, v in results.items()}
    model = "gpu_decode.py's TINY text model, a 2-block tower" if args.tiny else \
        "issue 10's Qwen3.5 text model (0.8B dims) + a 12-block, 768-wide vision tower"
    command = "benchmarks/images.py " + shlex.join(sys.argv[1:])
    body = f"""`{command}` ({machine()}; {model}, random weights, fp32; a {args.size} x {args.size} PNG = {num_tokens}
image tokens after a 24-token system prompt; medians of {args.repeats} rounds, each against its peer in the same run).

| measurement | hyla (ms) | peer (ms) | hyla / peer |
|---|---|---|---|
| preprocessing (decode, resize, patches) | {med['prep']:.1f} | {med['prep_peer']:.1f} (transformers' `Qwen2VLImageProcessorPil`) | {med['prep'] / med['prep_peer']:.2f}x |
| vision tower | {med['tower']:.1f} | {med['tower_peer']:.1f} (transformers' `Qwen3_5VisionModel`) | {med['tower'] / med['tower_peer']:.2f}x |
| TTFT, new image (preprocessing + tower + prefill) | {med['cold']:.1f} | {med['cold_peer']:.1f} (transformers' forward, tower + prefill) | {med['cold'] / med['cold_peer']:.2f}x |
| TTFT, the same image, another question | {med['cached']:.1f} | {med['cold']:.1f} (hyla, new image) | {med['cached'] / med['cold']:.2f}x |
| TTFT, the same image after another system prompt | {med['embedded']:.1f} | {med['cold']:.1f} (hyla, new image) | {med['embedded'] / med['cold']:.2f}x |

The cached turn decodes and preprocesses the image again (its digest is its cache key) but runs neither the
tower nor the prefill of the system prompt and the image. After another system prompt the prefix cache serves
nothing, and the embedding cache (`mm_embedding_cache_mb`) serves the tower's output: that turn prefills the whole
prompt but runs no tower."""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
