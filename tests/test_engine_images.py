"""Images in prompts (a Qwen3.5 vision-language checkpoint): the engine's outputs equal transformers'
``Qwen3_5ForConditionalGeneration`` (its vision tower, multimodal RoPE and generation), and the prefix
cache tells images apart: the same workload with the cache on and off gives the same greedy tokens and
logprobs (1e-4, each request up to its first tie), with prefill chunks that cut images in two and pools
small enough to evict and retract; a repeated image hits, another image does not.
"""

from __future__ import annotations

import io
import random

import numpy as np
import PIL.Image
import pytest
import torch

from checkpoints import QWEN3_5_VL_TOKENS
from hyla import Engine
from hyla.engine.errors import RequestError
from hyla.model.image_processing import ImageProcessorConfig, load_image, process_image
from test_engine_differential import assert_drained, compare_outputs

VS, IMG, VE = (QWEN3_5_VL_TOKENS[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
TOL = 1e-4


def png(seed: int, height: int, width: int) -> bytes:
    """A random RGB image, PNG-encoded."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def image_prompt(*parts: list[int] | None) -> list[int]:
    """Token lists, each None an image's placeholder (``<|vision_start|><|image_pad|><|vision_end|>``)."""
    return [t for part in parts for t in ([VS, IMG, VE] if part is None else part)]


def greedy(max_new: int) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def expanded(path, prompt: list[int], images: list[bytes]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The prompt as transformers' processor gives it (each placeholder repeated to its image's token count),
    with the images' ``pixel_values`` and ``image_grid_thw``."""
    config = ImageProcessorConfig.from_dir(path, patch_size=8, temporal_patch_size=2, merge_size=2)
    done = [process_image(load_image(b), config) for b in images]
    ids, k = [], 0
    for t in prompt:
        if t == IMG:
            ids += [IMG] * done[k].num_tokens
            k += 1
        else:
            ids.append(t)
    return ids, torch.cat([d.pixel_values for d in done]), torch.tensor([d.grid_thw for d in done])


@pytest.fixture(scope="module")
def hf_model(qwen3_5_vl_path):
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(qwen3_5_vl_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("chunk", [8192, 5])
def test_images_equal_transformers(qwen3_5_vl_path, hf_model, chunk):
    """Two images of different shapes amid text: the prompt's logprobs, the greedy tokens and their logprobs
    equal transformers' within 1e-4, the prompt in one prefill step or in chunks of 5 tokens (each image cut
    in two, its embeddings sliced); ``prompt_tokens`` counts the images' tokens."""
    images = [png(1, 40, 24), png(2, 30, 50)]
    prompt = image_prompt([5, 6, 7], None, [9, 10, 11, 12], None, [13, 14])
    ids, pixels, grid = expanded(qwen3_5_vl_path, prompt, images)
    engine = Engine(qwen3_5_vl_path, max_running_requests=4, debug_checks=True, chunked_prefill_size=chunk)
    try:
        out = engine.generate(input_ids=prompt, image_data=images, sampling_params=greedy(8), return_logprob=True,
                              logprob_start_len=0)
    finally:
        engine.shutdown()
    assert out["meta_info"]["prompt_tokens"] == len(ids) > len(prompt)
    input_ids, mm = torch.tensor([ids]), (torch.tensor([ids]) == IMG).int()
    gen = hf_model.generate(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm,
                            max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    hf_ids = gen.sequences[0, len(ids):].tolist()
    assert out["output_ids"] == hf_ids
    hf_lp = torch.stack([torch.log_softmax(s[0].float(), -1) for s in gen.scores])[torch.arange(8), hf_ids]
    ours = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert (hf_lp - ours).abs().max() < TOL
    with torch.no_grad():
        logits = hf_model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=mm).logits[0]
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(len(ids) - 1), input_ids[0, 1:]]
    prompt_lp = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    assert (ref - prompt_lp).abs().max() < TOL


def test_an_image_changes_the_answer_and_text_alone_does_not_fake_one(qwen3_5_vl_path):
    """The same text with two different images gives two different answers (the image is read), and a
    prompt without image_data runs as text (its placeholder an ordinary token, as transformers would)."""
    prompt = image_prompt([5, 6], None, [7, 8, 9])
    engine = Engine(qwen3_5_vl_path, max_running_requests=4, enable_prefix_cache=False)
    try:
        a, b = (engine.generate(input_ids=prompt, image_data=[png(s, 32, 32)], sampling_params=greedy(6),
                                return_logprob=True) for s in (3, 4))
        assert a["meta_info"]["output_token_logprobs"] != b["meta_info"]["output_token_logprobs"]
        text = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=greedy(4))
        assert text["meta_info"]["prompt_tokens"] == 4
    finally:
        engine.shutdown()


def test_the_cache_hits_the_same_image_and_misses_another(qwen3_5_vl_path):
    """A repeated prompt with its image hits all but its last token; the same text with another image does
    not hit through the image; the same image with other text after it hits through the image from the
    second time the prompts branch there (as any shared prefix: the state is kept where prompts branched);
    each answer equals a cache-off engine's."""
    sys_ids = [5, 6, 7, 8, 9]
    first, other = png(5, 48, 48), png(6, 48, 48)
    prompt = image_prompt(sys_ids, None, [11, 12, 13])
    n = len(expanded(qwen3_5_vl_path, prompt, [first])[0])
    on = Engine(qwen3_5_vl_path, max_running_requests=4, debug_checks=True)
    off = Engine(qwen3_5_vl_path, max_running_requests=4, enable_prefix_cache=False)
    try:
        runs = [(prompt, [first]), (prompt, [first]), (prompt, [other]), (image_prompt(sys_ids, None, [14, 15]), [first]),
                (image_prompt(sys_ids, None, [16]), [first])]
        outs, refs = [], []
        for ids, images in runs:
            outs.append(on.generate(input_ids=ids, image_data=images, sampling_params=greedy(5), return_logprob=True))
            refs.append(off.generate(input_ids=ids, image_data=images, sampling_params=greedy(5), return_logprob=True))
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        image_end = n - 3  # the tokens through <|vision_end|>
        # (2) the other image: nothing (its prompt's keys part from the first's at the image, where no state is
        # kept yet); (3) the first image again, other text: up to that branch (<|vision_start|>), whose state the
        # tree kept when (2) branched there; (4) once more: through the image, where (3) branched off
        assert cached == [0, n - 1, 0, len(sys_ids) + 1, image_end]
        assert compare_outputs(outs, refs) == 5 * len(runs)
        assert_drained(on)
    finally:
        on.shutdown()
        off.shutdown()


def make_image_workload(seed: int, images: list[bytes]) -> list[dict]:
    """Requests of text and images: groups sharing a system prompt and an image, others sharing the text but
    not the image, a few with two images, one with none."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    systems = [tok(rng.randrange(8, 40)) for _ in range(3)]
    specs = []
    for i in range(14):
        system = systems[i % 3]
        picks = [rng.randrange(len(images)) for _ in range(1 + (i % 5 == 0))]
        parts: list = [system]
        for p in picks:
            parts += [None, tok(rng.randrange(1, 12))]
        specs.append({"ids": image_prompt(*parts), "images": [images[p] for p in picks],
                      "max_new": rng.randrange(2, 24) if i % 4 else rng.randrange(30, 40)})
    specs.append({"ids": systems[0] + tok(10), "images": None, "max_new": 8})
    return specs


@pytest.mark.parametrize("pressure", ["roomy", "evicting"])
def test_cache_on_and_off_agree_with_images(qwen3_5_vl_path, pressure):
    """The differential test with images: two waves (the second repeats the first's prompts and images,
    after other images went by), prefill chunks of 12 tokens (images of 16 tokens cut in two, a hit ending
    mid-image); under pressure the pools are small enough to evict and retract."""
    images = [png(10 + i, 64, 64) for i in range(3)] + [png(20, 40, 56)]
    specs = make_image_workload(0, images)
    kw = dict(max_running_requests=6, chunked_prefill_size=12, debug_checks=True)
    if pressure == "evicting":
        kw.update(max_total_tokens=300, max_state_slots=12)

    def run(engine: Engine, wave: list[dict]) -> list[dict]:
        return engine.generate(input_ids=[s["ids"] for s in wave], image_data=[s["images"] for s in wave],
                               sampling_params=[greedy(s["max_new"]) for s in wave], return_logprob=True)

    on = Engine(qwen3_5_vl_path, **kw)
    off = Engine(qwen3_5_vl_path, **{**kw, "enable_prefix_cache": False})
    try:
        outs = run(on, specs) + run(on, specs[::-1])
        refs = run(off, specs) + run(off, specs[::-1])
        assert compare_outputs(outs, refs) > 300
        assert sum(o["meta_info"]["cached_tokens"] for o in outs[len(specs):]) > 0
        stats = on.get_stats()
        if pressure == "evicting":
            assert stats["num_retractions"] > 0 and stats["num_evicted_tokens"] + stats["num_evicted_states"] > 0, \
                {k: v for k, v in stats.items() if "retract" in k or "evict" in k}
        assert_drained(on)
    finally:
        on.shutdown()
        off.shutdown()


def test_bad_images_are_refused_and_lose_nothing(qwen3_5_vl_path, qwen3_5_path):
    """Each malformed request is a RequestError naming image_data, nothing is admitted, and the engine
    then serves a good request as before."""
    engine = Engine(qwen3_5_vl_path, max_running_requests=2, debug_checks=True)
    prompt = image_prompt([5], None, [6])
    good = png(7, 32, 32)
    try:
        cases = [
            (prompt, [b"not an image"], "image"),
            (prompt, [good, good], "2 image"),  # one placeholder for two images
            (image_prompt([5], None, [6], None), [good], "placeholder"),
            (prompt, ["data:image/png;base64,%%%"], "base64"),
            (prompt, [png(8, 2, 500)], "aspect ratio"),
        ]
        for ids, images, words in cases:
            with pytest.raises(RequestError, match=words) as err:
                engine.generate(input_ids=ids, image_data=images, sampling_params=greedy(2))
            assert err.value.param == "image_data"
        out = engine.generate(input_ids=prompt, image_data=[good], sampling_params=greedy(3))
        assert len(out["output_ids"]) == 3
        assert_drained(engine)
    finally:
        engine.shutdown()
    text_only = Engine(qwen3_5_path, max_running_requests=2)
    try:
        with pytest.raises(RequestError, match="takes no images"):
            text_only.generate(input_ids=[5, 6], image_data=[good], sampling_params=greedy(2))
    finally:
        text_only.shutdown()
