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


def test_cache_on_and_off_agree_with_images(qwen3_5_vl_path):
    """The differential test with images: two waves (the second repeats the first's prompts and images,
    after other images went by), prefill chunks of 12 tokens (images of 16 tokens cut in two, a hit ending
    mid-image), pools small enough to evict and retract (the hits of a roomy cache: the test above)."""
    images = [png(10 + i, 64, 64) for i in range(3)] + [png(20, 40, 56)]
    specs = make_image_workload(0, images)
    kw = dict(max_running_requests=6, chunked_prefill_size=12, debug_checks=True, max_total_tokens=300,
              max_state_slots=12)

    def run(engine: Engine, wave: list[dict]) -> list[dict]:
        return engine.generate(input_ids=[s["ids"] for s in wave], image_data=[s["images"] for s in wave],
                               sampling_params=[greedy(s["max_new"]) for s in wave], return_logprob=True)

    on = Engine(qwen3_5_vl_path, **kw)  # (the images' embeddings kept too: mm_embedding_cache_mb)
    off = Engine(qwen3_5_vl_path, **{**kw, "enable_prefix_cache": False, "mm_embedding_cache_mb": 0})
    try:
        outs = run(on, specs) + run(on, specs[::-1])
        refs = run(off, specs) + run(off, specs[::-1])
        assert compare_outputs(outs, refs) > 300
        assert sum(o["meta_info"]["cached_tokens"] for o in outs[len(specs):]) > 0
        stats = on.get_stats()
        assert stats["num_retractions"] > 0 and stats["num_evicted_tokens"] + stats["num_evicted_states"] > 0, \
            {k: v for k, v in stats.items() if "retract" in k or "evict" in k}
        assert stats["num_image_encodes"] == len(images) and stats["num_image_cache_hits"] > 0
        assert off.get_stats()["num_image_cache_hits"] == 0
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


def text_model_of(path, out):
    """The text model of the vision-language checkpoint ``path`` as a ``Qwen3_5ForCausalLM`` checkpoint in ``out``."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    text = {**config["text_config"], "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    (out / "config.json").write_text(json.dumps(text))
    tensors = {k.replace("model.language_model.", "model."): v
               for k, v in load_file(path / "model.safetensors").items() if not k.startswith("model.visual.")}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_draft_model_speculation_with_images_is_exact(qwen3_5_vl_path, tmp_path):
    """A text-only draft model (here the target's own text model) runs the target's requests as text (the
    placeholder tokens at their indices); the target verifies at its images' positions: the outputs of a batch
    of text and image requests equal plain decoding's (a draft model that took the images' embeddings would
    fail every step)."""
    qwen3_5_path = text_model_of(qwen3_5_vl_path, tmp_path / "text")
    specs = [([5, 6, 7, 8, 9], None), (image_prompt([5, 6, 7], None, [20, 21, 22, 23]), [png(5, 48, 48)]),
             (image_prompt([11], None, [12], None, [13]), [png(6, 32, 32), png(7, 16, 48)])]

    def run(engine: Engine) -> list[dict]:
        return engine.generate(input_ids=[ids for ids, _ in specs], image_data=[images for _, images in specs],
                               sampling_params=greedy(12), return_logprob=True)

    with Engine(qwen3_5_vl_path, max_running_requests=4, enable_prefix_cache=False) as plain:
        want = run(plain)
    with Engine(qwen3_5_vl_path, max_running_requests=4, speculative_algorithm="draft", speculative_num_steps=3,
                speculative_draft_model_path=str(qwen3_5_path), debug_checks=True) as spec:
        got = run(spec)
        assert spec.scheduler.num_accepted_tokens > 0
        assert_drained(spec)
    assert compare_outputs(got, want) == 12 * len(specs)


def test_a_failing_vision_tower_ends_only_its_request(qwen3_5_vl_path, monkeypatch):
    """The tower runs as a request's chunk joins a step, outside the step: when it fails (a device out of
    memory on a large image, say), that request alone ends aborted; a text request and a small image's run
    on, and the engine serves after."""
    from hyla.model import vision

    forward = vision.VisionTower.forward

    def failing(self, pixel_values, grids):
        if any(h * w > 40 for _, h, w in grids):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, pixel_values, grids)

    monkeypatch.setattr(vision.VisionTower, "forward", failing)
    with Engine(qwen3_5_vl_path, max_running_requests=4, debug_checks=True) as engine:
        outs = engine.generate(input_ids=[[5, 6, 7, 8], image_prompt([5], None, [6]), image_prompt([5], None, [7])],
                               image_data=[None, [png(1, 64, 64)], [png(2, 16, 16)]], sampling_params=greedy(4))
        reasons = [o["meta_info"]["finish_reason"] for o in outs]
        assert reasons[1]["type"] == "abort" and reasons[1]["cause"] == "internal", reasons
        assert reasons[0]["type"] == reasons[2]["type"] == "length", reasons
        assert len(engine.generate(input_ids=[5, 6], sampling_params=greedy(2))["output_ids"]) == 2
        assert_drained(engine)


def test_embeddings_go_once_the_prefill_passed_the_image_and_come_back_when_needed(qwen3_5_vl_path):
    """A request holds its images' embeddings only while its prefill needs them; re-admitted after a retraction
    (its cache evicted), it runs the tower again from the pixels it kept, and its answer is unchanged."""
    prompt = image_prompt([5, 6, 7], None, list(range(20, 50)))
    image = png(9, 64, 64)
    with Engine(qwen3_5_vl_path, max_running_requests=2, chunked_prefill_size=8, enable_prefix_cache=False) as off:
        want = off.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(6), return_logprob=True)
    with Engine(qwen3_5_vl_path, max_running_requests=2, chunked_prefill_size=8, debug_checks=True) as engine:
        held = []
        runs = {"n": 0}
        scheduler = engine.scheduler
        process, embed = scheduler.process, scheduler._embed_images

        def watch(*args, **kwargs):
            out = process(*args, **kwargs)
            for r in scheduler.running:
                if r.images is not None:
                    held.append((r.kv_len, [item.embeds is not None for item in r.images.items]))
            return out

        def count(req, n):
            before = [item.embeds is None for item in req.images.items] if req.images is not None else []
            embed(req, n)
            runs["n"] += sum(b and item.embeds is not None for b, item in zip(before, req.images.items or []))

        scheduler.process, scheduler._embed_images = watch, count
        first = engine.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(6), return_logprob=True)
        end = len(prompt) - 3 - 30 + want["meta_info"]["prompt_tokens"] - len(prompt) + 3  # (through <|vision_end|>)
        assert held and all(not any(flags) for kv_len, flags in held if kv_len >= end - 1)
        assert runs["n"] == 1
        engine.flush_cache()
        again = engine.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(6), return_logprob=True)
        assert runs["n"] == 2  # (nothing cached: the tower again)
    assert compare_outputs([first, again], [want, want]) == 12


def test_images_that_fill_the_context_are_refused_from_their_headers(qwen3_5_vl_path):
    """Images whose tokens (known from each header: its size) fill the context are refused before any is
    decoded."""
    import base64

    big = PIL.Image.new("RGB", (64, 64))  # 16 tokens at most (64 x 64 pixels: the checkpoint's max_pixels)
    buf = io.BytesIO()
    big.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with Engine(qwen3_5_vl_path, max_running_requests=2, context_length=40) as engine:
        with pytest.raises(RequestError, match="the images take .* context length") as err:
            engine.generate(input_ids=image_prompt([5], None, [6], None, [7], None), image_data=[url] * 3,
                            sampling_params=greedy(2))
        assert err.value.param == "image_data"
        assert engine.generate(input_ids=image_prompt([5], None), image_data=[url],
                               sampling_params=greedy(2))["meta_info"]["prompt_tokens"] == 1 + 2 + 16


def test_the_embedding_cache_runs_the_tower_once_per_image(qwen3_5_vl_path):
    """The vision tower's outputs kept by image content: a batch of one prompt three times (n choices), the
    image again after other text (the prefix cache's hit ends before it), an image twice in one prompt and
    both images in another prompt run the tower once per image; each answer equals an engine's that keeps
    nothing; ``flush_cache`` empties it. (A hit ending inside an image: the differential test above.)"""
    a, b = png(31, 48, 48), png(32, 40, 40)
    prompt = image_prompt([5, 6], None, [7, 8, 9])
    runs = [dict(input_ids=[prompt] * 3, image_data=[[a]] * 3),  # the tower runs once (the prefix cache serves 2)
            dict(input_ids=image_prompt([5, 6], None, [10]), image_data=[a]),  # a from the cache
            dict(input_ids=image_prompt([5, 6], None, [11]), image_data=[a]),  # the prefix cache's hit passes a
            dict(input_ids=image_prompt([4], None, [9], None, [8]), image_data=[b, b]),  # b once, then from the cache
            dict(input_ids=image_prompt([3], None, [2], None), image_data=[a, b])]  # both from the cache
    kw = dict(max_running_requests=4, chunked_prefill_size=8, debug_checks=True)
    with Engine(qwen3_5_vl_path, **kw) as on, \
            Engine(qwen3_5_vl_path, **kw, enable_prefix_cache=False, mm_embedding_cache_mb=0) as off:
        cache = on.scheduler.runner.image_cache
        seen = []
        for run in runs:
            outs, refs = (e.generate(**run, sampling_params=greedy(4), return_logprob=True) for e in (on, off))
            outs, refs = (x if isinstance(x, list) else [x] for x in (outs, refs))
            assert compare_outputs(outs, refs) == 4 * len(outs)
            stats = on.get_stats()
            seen.append((stats["num_image_encodes"], stats["num_image_cache_hits"]))
        assert seen == [(1, 0), (1, 1), (1, 1), (2, 2), (2, 4)], seen
        tokens = sum(image.num_tokens for image in on.process_images([a, b]))
        assert len(cache) == 2 and cache.bytes == tokens * on.model_config.hidden_size * 4  # (fp32)
        assert off.get_stats()["num_image_cache_hits"] == 0 and len(off.scheduler.runner.image_cache) == 0
        assert off.get_stats()["num_image_encodes"] == 3 + 1 + 1 + 2 + 2  # (b's second time: a later chunk)
        assert on.flush_cache() and len(cache) == 0 and cache.bytes == 0
        on.generate(**runs[1], sampling_params=greedy(2))
        assert on.get_stats()["num_image_encodes"] == 3 and len(cache) == 1
        # a weight update empties it too (the old weights computed what it holds): the tower runs again
        on.update_weights_from_disk(qwen3_5_vl_path)
        assert len(on.scheduler.runner.image_cache) == 0
        on.generate(**runs[1], sampling_params=greedy(2))
        assert on.get_stats()["num_image_encodes"] == 4
        assert_drained(on)
    # n choices computed side by side (no prefix cache to serve them): the tower runs for the first alone; an
    # image twice in one chunk: once
    with Engine(qwen3_5_vl_path, max_running_requests=4, enable_prefix_cache=False) as apart:
        apart.generate(**runs[0], sampling_params=greedy(2))
        stats = apart.get_stats()
        assert (stats["num_image_encodes"], stats["num_image_cache_hits"]) == (1, 2)
        apart.generate(**{**runs[3], "image_data": [png(33, 32, 32)] * 2}, sampling_params=greedy(2))
        stats = apart.get_stats()
        assert (stats["num_image_encodes"], stats["num_image_cache_hits"]) == (2, 2)


def test_a_prompts_images_are_limited_and_their_preprocessing_overridden(qwen3_5_vl_path, qwen3_5_path):
    """vLLM's limit_mm_per_prompt refuses a prompt of more images before decoding any; mm_processor_kwargs
    (the engine's, or a request's through process_images) bound a resized image's area, so its tokens, and the
    engine's override gives the request's answer; what is not such an option is refused."""
    from hyla.engine.args import EngineArgs
    from hyla.model.image_processing import image_tokens

    image = png(41, 64, 64)
    prompt = image_prompt([5], None, [6, 7])
    with Engine(qwen3_5_vl_path, max_running_requests=2, limit_mm_per_prompt={"image": 1},
                mm_processor_kwargs={"max_pixels": 32 * 32}, debug_checks=True) as small:
        with pytest.raises(RequestError, match="at most 1 .*limit_mm_per_prompt") as err:
            small.generate(input_ids=image_prompt([5], None, [6], None), image_data=[image, b"not an image"],
                           sampling_params=greedy(2))
        assert err.value.param == "image_data"
        config = small.image_processor
        assert config.max_pixels == 32 * 32 and (small.process_images([image])[0].num_tokens
                                                 == image_tokens(64, 64, config) == 4)
        got = small.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(5), return_logprob=True)
        assert got["meta_info"]["prompt_tokens"] == 1 + 1 + 4 + 1 + 2  # ([5], vision start, 4 image tokens, end, [6, 7])
        assert_drained(small)
    with Engine(qwen3_5_vl_path, max_running_requests=2) as engine:
        assert engine.process_images([image])[0].num_tokens == 16  # (the checkpoint's bounds)
        done = engine.process_images([image], {"max_pixels": 32 * 32})
        want = engine.generate(input_ids=prompt, image_data=done, sampling_params=greedy(5), return_logprob=True)
        for bad, match in (({"size": 4}, "not an image preprocessing option"), ({"max_pixels": 0}, "max_pixels must"),
                           ({"min_pixels": 10 ** 6}, "min_pixels .* is above this engine's max_pixels"),
                           ({"max_pixels": 64 * 64 + 1}, "not raise it past"), ([1], "an object")):
            with pytest.raises(RequestError, match=match) as err:
                engine.process_images([image], bad)
            assert err.value.param == "mm_processor_kwargs"
        # the counts from the images' headers alone are the processed images' (the engine's bounds or a request's)
        sizes = [png(42, h, w) for h, w in ((64, 64), (40, 56), (16, 200), (100, 30))]
        for kwargs in (None, {"max_pixels": 32 * 32}, {"min_pixels": 48 * 48}):
            assert engine.count_image_tokens(sizes, kwargs) == [
                image.num_tokens for image in engine.process_images(sizes, kwargs)]
        with pytest.raises(RequestError, match="not an image"):
            engine.count_image_tokens([b"nothing"])
    # a request's bounds stay within the engine's: small's cap (32 x 32 pixels) holds against a request
    with Engine(qwen3_5_vl_path, max_running_requests=2, mm_processor_kwargs={"max_pixels": 32 * 32},
                context_length=24) as small:
        with pytest.raises(RequestError, match="not raise it past"):
            small.process_images([image], {"max_pixels": 64 * 64})
        with pytest.raises(RequestError, match="the images take .* context length") as err:  # (counted as processed)
            small.count_image_tokens([image] * 6)
        assert err.value.param == "image_data" and small.count_image_tokens([image] * 5) == [4] * 5
        assert_drained(engine)
    assert compare_outputs([got], [want]) == 5
    for kw, match in ((dict(limit_mm_per_prompt={"audio": 1}), "not a modality"),
                      (dict(limit_mm_per_prompt={"video": 1}), "no videos"),
                      (dict(limit_mm_per_prompt={"image": -1}), "image must be an integer"),
                      (dict(limit_mm_per_prompt=3), "an object"),
                      (dict(mm_processor_kwargs={"min_pixels": 9, "max_pixels": 8}), "above max_pixels")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**kw)
    with pytest.raises(ValueError, match="takes none"):
        Engine(qwen3_5_path, limit_mm_per_prompt={"image": 2})


def test_a_prefix_with_images_moves_between_engines(qwen3_5_vl_path, qwen3_5_path):
    """export_prefix / import_prefix / cached_tokens with image_data: the prefix is keyed by the images, so the
    importing engine's request hits all of it but its last token and answers as computed there; with prompt
    logprobs, the limit is counted past the images; another image finds nothing; a text model refuses image
    keys."""
    image, other = png(51, 64, 64), png(52, 64, 64)
    prompt = image_prompt([5, 6], None, list(range(20, 30)))
    kw = dict(max_running_requests=2, debug_checks=True)
    with Engine(qwen3_5_vl_path, **kw) as source, Engine(qwen3_5_vl_path, **kw) as target:
        want = target.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(4), return_logprob=True)
        n = want["meta_info"]["prompt_tokens"]
        assert target.flush_cache()
        source.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(1))
        assert source.cached_tokens(prompt, image_data=[image]) == n - 1
        assert source.cached_tokens(prompt, image_data=[other]) == 0  # (no state kept before the image)
        # (prompt logprobs from position 6 as given, 21 with the image's 16 tokens: a cache may serve 20 of them)
        assert source.cached_tokens_by_tier(prompt, image_data=[image], logprob_start_len=6)[2] == 6 + 15 - 1
        prefix = source.export_prefix(prompt, image_data=image)
        assert len(prefix) == n - 1 and min(prefix.token_ids) < 0  # (the image's tokens: its key)
        assert target.import_prefix(prefix.to_bytes()) == n - 1
        assert target.cached_tokens(prompt, image_data=[image]) == n - 1
        got = target.generate(input_ids=prompt, image_data=[image], sampling_params=greedy(4), return_logprob=True)
        assert got["meta_info"]["cached_tokens"] == n - 1
        assert target.get_stats()["num_image_encodes"] == 1  # (want's; got's image was in the prefix)
        assert_drained(source)
        assert_drained(target)
    assert compare_outputs([got], [want]) == 4
    with Engine(qwen3_5_path, max_running_requests=2) as text:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            text.import_prefix(prefix.to_bytes())


def test_the_embedding_cache_keeps_the_most_recently_used_within_its_bytes():
    from hyla.engine.multimodal import EmbeddingCache

    cache = EmbeddingCache(3 * 40)  # three [10] fp32 tensors
    rows = {k: torch.full((10,), float(i)) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for k in (b"a", b"b", b"c"):
        cache.put(k, rows[k])
    assert torch.equal(cache.get(b"a"), rows[b"a"]) and cache.num_hits == 1  # (a: the most recently used now)
    cache.put(b"d", rows[b"d"])  # b, the least recently used, makes room
    assert cache.get(b"b") is None and all(torch.equal(cache.get(k), rows[k]) for k in (b"a", b"c", b"d"))
    assert len(cache) == 3 and cache.bytes == 120
    # a view of a larger run's output is kept as a copy of its own: the bytes counted are the bytes held
    run = torch.zeros(40, 10)
    cache.put(b"f", run[3])
    assert cache.get(b"f").untyped_storage().nbytes() == 40 and cache.bytes == 120
    cache.put(b"e", torch.zeros(31))  # larger than the whole budget: not kept, nothing dropped
    assert cache.get(b"e") is None and len(cache) == 3
    assert cache.clear() == 3 and cache.bytes == 0 and cache.get(b"a") is None
    assert len(EmbeddingCache(0)) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            EmbeddingCache(bad)
    from hyla.engine.args import EngineArgs
    for bad in (-1, 2.0, None):
        with pytest.raises(ValueError, match="mm_embedding_cache_mb"):
            EngineArgs(mm_embedding_cache_mb=bad)


@pytest.fixture(scope="module")
def qwen3_5_vl_short_path(tiny_ckpt_dir):
    """Two layers (Gated DeltaNet, attention): for the interpreted fused kernels, whose time grows with the layers."""
    from checkpoints import make_qwen3_5_vl

    return make_qwen3_5_vl(tiny_ckpt_dir, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


@pytest.mark.slow
def test_fused_extends_after_an_image_run_at_its_positions(qwen3_5_vl_short_path):
    """On a fused runner (the Triton kernels: interpreted without a GPU) the text after an image runs as fused
    extends, at the positions the image shifted, attending to every key before it: a prompt whose last chunk is
    text after the image, then a turn that hits through the image, equal the PyTorch steps' answers."""
    from hyla.engine.model_runner import ModelRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    image = png(5, 48, 48)
    first = image_prompt([5, 6, 7], None, list(range(20, 40)))
    opts = dict(device=device, max_running_requests=2, warmup="off", chunked_prefill_size=24)

    def turns(engine: Engine) -> list[dict]:
        a = engine.generate(input_ids=first, image_data=[image], sampling_params=greedy(3), return_logprob=True,
                            checkpoints=[len(first) - 20])  # (the state after the image kept: a message end)
        b = engine.generate(input_ids=first[:-20] + list(range(50, 60)), image_data=[image], sampling_params=greedy(3),
                            return_logprob=True)
        assert b["meta_info"]["cached_tokens"] == a["meta_info"]["prompt_tokens"] - 20  # (through the image)
        return [a, b]

    with Engine(qwen3_5_vl_short_path, **opts) as plain:
        plain.scheduler.runner = ModelRunner(plain.model, plain.kv_pool, plain.state_pool, plain.req_to_token,
                                             plain.device, cuda_graph=False, fused_decode=False)
        want = turns(plain)
    with Engine(qwen3_5_vl_short_path, **opts) as fused:
        fused.scheduler.runner = runner = ModelRunner(fused.model, fused.kv_pool, fused.state_pool, fused.req_to_token,
                                                      fused.device, cuda_graph=False, fused_decode=True,
                                                      fused_extend_max_tokens=32)
        ran = []
        original = runner._forward_extend_fused
        runner._forward_extend_fused = lambda req, n, *a: ran.append((req.kv_len, n)) or original(req, n, *a)
        got = turns(fused)
    assert len(ran) >= 2, ran  # (the text after the image in the first turn, the second turn's new text)
    assert compare_outputs(got, want) == 6


@pytest.mark.gpu
def test_images_on_a_gpu_equal_the_cpu(qwen3_5_vl_path):
    """On CUDA, fp32, the default engine (fused kernels, CUDA graphs, fused extends, the overlap schedule):
    the cache workload with images, cache on, equals the CPU engine's with the cache off (the tower and an
    image's extend on the PyTorch path, the text after it through the fused extends and decode graphs)."""
    images = [png(10 + i, 64, 64) for i in range(3)] + [png(20, 40, 56)]
    specs = make_image_workload(1, images)

    def run(engine: Engine, wave: list[dict]) -> list[dict]:
        return engine.generate(input_ids=[s["ids"] for s in wave], image_data=[s["images"] for s in wave],
                               sampling_params=[greedy(s["max_new"]) for s in wave], return_logprob=True)

    with Engine(qwen3_5_vl_path, device="cuda", max_running_requests=6, chunked_prefill_size=12) as gpu:
        got = run(gpu, specs) + run(gpu, specs[::-1])
        assert sum(o["meta_info"]["cached_tokens"] for o in got[len(specs):]) > 0
    with Engine(qwen3_5_vl_path, max_running_requests=6, chunked_prefill_size=12, enable_prefix_cache=False) as cpu:
        want = run(cpu, specs) + run(cpu, specs[::-1])
    assert compare_outputs(got, want) > 300
