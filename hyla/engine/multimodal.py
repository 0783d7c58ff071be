"""A prompt's images, as a request carries them: where their tokens sit, how the cache names them,
their positions, and their embeddings once the vision tower has run.

A prompt names an image with one image token (``<|image_pad|>``, ``VisionConfig.image_token_id``;
a chat template writes ``<|vision_start|><|image_pad|><|vision_end|>``); :func:`expand_images`
repeats it to the image's token count (``ProcessedImage.num_tokens``), in order, as transformers'
processor does.

The prefix cache must tell images apart though their placeholder tokens are the same id: in the
keys the tree sees (``Req.fill_keys``), each image's tokens take a negative id drawn from its digest
(no token id is negative), so two prompts share a cached prefix exactly as far as their tokens
and images agree. The model still reads the placeholder id (``Req.tokens``), whose embedding the
image's replaces (``ForwardBatch.mm_rows``).

The vision tower runs when a prefill chunk first needs rows of an image, and not for an image the prefix
cache already holds: the scheduler has it run as it adds the chunk to a step (:meth:`PromptImages.encode`,
outside the step, so that a failure ends only that request), and the step reads the rows it feeds
(:meth:`PromptImages.embeddings`). The embeddings are dropped once the prefill has passed the image
(:meth:`PromptImages.release`); the image itself, its resized uint8 pixels, stays with the request, which
runs the tower again should it prefill the image again (after a retraction, its cache evicted).

Between requests, an :class:`EmbeddingCache` keeps the tower's outputs by image digest (SGLang's
``MultiModalCache``, vLLM's encoder cache): the ``n`` choices of a request, a prompt whose cache hit
ends inside an image, the same image in another prompt or twice in one run the tower once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hyla.model.image_processing import ProcessedImage
from hyla.model.vision import VisionConfig, image_positions

Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor]
"""The vision tower: ``(pixel_values [P, patch_dim], grids) -> embeddings [P / merge**2, hidden]``."""


@dataclass(eq=False)
class PromptImage:
    """One image of a prompt: its tokens ``[offset, offset + num_tokens)``."""

    offset: int
    key: int  # the id its tokens take in the cache's keys (negative, from its digest)
    image: ProcessedImage  # its pixels (uint8, on the host): kept while the request lives
    embeds: torch.Tensor | None = None  # [num_tokens, hidden] in the model dtype, on its device, while needed

    @property
    def num_tokens(self) -> int:
        return self.image.num_tokens

    @property
    def grid(self) -> tuple[int, int, int]:
        return self.image.grid_thw

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(eq=False)
class PromptImages:
    """The images of a request's prompt (``Req.images``) and the prompt's multimodal RoPE positions."""

    prompt_len: int
    items: list[PromptImage]
    positions: torch.Tensor  # [3, prompt_len] int64: each prompt token's (time, height, width) position
    rope_delta: int  # a token after the prompt is at position index + rope_delta (on all three axes)
    _keys: list[int] | None = field(default=None, repr=False)

    def key_ids(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` with each image's tokens replaced by its key (computed once)."""
        if self._keys is None:
            keys = list(prompt)
            for item in self.items:
                keys[item.offset:item.end] = [item.key] * item.num_tokens
            self._keys = keys
        return self._keys

    def touches_image(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` hold any image token."""
        return bool(self._touched(start, end))

    def expanded(self, position: int) -> int:
        """Where ``position`` of the prompt as given (one placeholder token per image) lies in this one, each
        placeholder repeated to its image's tokens: moved past the images before it."""
        added = 0
        for item in self.items:
            if item.offset - added >= position:  # (the placeholder's place in the prompt as given)
                break
            added += item.num_tokens - 1
        return position + added

    def shift(self, start: int) -> int:
        """How far the RoPE position of token ``start`` (a text token, or one past the prompt) lies from
        its index: the same for every token up to the next image."""
        if start >= self.prompt_len:
            return self.rope_delta
        return int(self.positions[0, start]) - start

    def rope_positions(self, start: int, n: int) -> torch.Tensor:
        """``[3, n]``: the positions of tokens ``[start, start + n)`` (those past the prompt at index + delta)."""
        inside = self.positions[:, start:min(start + n, self.prompt_len)]
        rest = max(0, start + n - max(start, self.prompt_len))
        if not rest:
            return inside
        after = torch.arange(max(start, self.prompt_len), start + n) + self.rope_delta
        return torch.cat([inside, after.expand(3, rest)], dim=1)

    def _touched(self, start: int, end: int) -> list[PromptImage]:
        return [item for item in self.items if item.offset < end and start < item.end]

    def needs_encoding(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` reach an image not embedded now."""
        return any(item.embeds is None for item in self._touched(start, end))

    def encode(self, start: int, end: int, encode: Encoder, cache: EmbeddingCache | None = None) -> None:
        """Embed the images tokens ``[start, end)`` reach that are not embedded now: each from ``cache``
        where it holds the image, the others by the vision tower ``encode`` (once, on them together; an
        image twice among them once), their embeddings then put in ``cache``."""
        new = [item for item in self._touched(start, end) if item.embeds is None]
        if cache is not None:
            for item in new:
                item.embeds = cache.get(item.image.digest)
        todo = list({item.image.digest: item for item in new if item.embeds is None}.values())
        if not todo:
            return
        out = encode(torch.cat([item.image.pixel_values for item in todo]), [item.grid for item in todo])
        found = dict(zip((item.image.digest for item in todo), out.split([item.num_tokens for item in todo])))
        for item in new:
            if item.embeds is None:
                item.embeds = found[item.image.digest]
        if cache is not None:
            for digest, embeds in found.items():
                cache.put(digest, embeds)
            cache.num_encoded += len(found)

    def release(self, done: int) -> None:
        """Drop the embeddings of the images wholly among the first ``done`` tokens (computed: a prefill's)."""
        for item in self.items:
            if item.end <= done:
                item.embeds = None

    def embeddings(self, start: int, end: int, encode: Encoder,
                   cache: EmbeddingCache | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The image rows of tokens ``[start, end)``: their offsets from ``start`` and their embeddings
        ``[K, hidden]`` (None when there are none); the images not embedded yet are first (:meth:`encode`)."""
        self.encode(start, end, encode, cache)
        wanted = self._touched(start, end)
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for item in wanted:
            lo, hi = max(start, item.offset), min(end, item.end)
            rows.extend(range(lo - start, hi - start))
            parts.append(item.embeds[lo - item.offset:hi - item.offset])
        return rows, (torch.cat(parts) if parts else None)


class EmbeddingCache:
    """The vision tower's outputs (``[num_tokens, hidden]``, on the model's device) by image digest
    (``ProcessedImage.digest``: its resized pixels, grid and preprocessing), the least recently used
    dropped past ``max_bytes``; 0 keeps none. Its embeddings are the tower's for the same pixels, so a hit
    changes nothing the model computes; they were computed with the weights served then: a weight update
    empties it (``Scheduler.flush_cache``). One thread (the scheduler's) uses it.

    A request keeps the embeddings it reads until its prefill has passed the image
    (:meth:`PromptImages.release`), whether the cache drops them or not: the cache's bytes are its own
    references, a bound on what it alone keeps alive."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.num_hits = 0  # images embedded from the cache
        self.num_encoded = 0  # images the tower embedded (its runs' images, each once)
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> torch.Tensor | None:
        embeds = self._entries.get(digest)
        if embeds is not None:
            self._entries.move_to_end(digest)
            self.num_hits += 1
        return embeds

    def put(self, digest: bytes, embeds: torch.Tensor) -> None:
        """Keep ``embeds`` (not one larger than the whole budget), dropping the least recently used to fit."""
        size = embeds.numel() * embeds.element_size()
        if size > self.max_bytes or digest in self._entries:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        # a copy: ``embeds`` is a view of the tower's output for all the images of its run, which it would keep alive
        self._entries[digest] = embeds.clone()
        self.bytes += size

    def clear(self) -> int:
        """Drop every entry; how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self.bytes = 0
        return n


def image_key(digest: bytes) -> int:
    """The negative id an image's tokens take in the cache's keys: 63 bits of its digest."""
    return -1 - (int.from_bytes(digest[:8], "big") >> 1)


def expand_images(input_ids: Sequence[int], images: Sequence[ProcessedImage],
                  vision: VisionConfig) -> tuple[list[int], PromptImages]:
    """The prompt with its image tokens repeated to each image's token count, and its
    :class:`PromptImages`. ``ValueError`` unless the prompt holds exactly one image token per image
    (the chat template's placeholder, not yet repeated) and each image has the tower's patches."""
    tok = vision.image_token_id
    marks = [i for i, t in enumerate(input_ids) if t == tok]
    if len(marks) != len(images):
        raise ValueError(f"the prompt has {len(marks)} image placeholder tokens (id {tok}) for {len(images)} "
                         "image(s): each image needs exactly one, where it goes")
    ids: list[int] = []
    items: list[PromptImage] = []
    columns: list[torch.Tensor] = []
    pos, prev = 0, 0
    for mark, image in zip(marks, images):
        c = image.config
        if (c.patch_size, c.temporal_patch_size, c.merge_size) != (
                vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ValueError(f"an image's patches ({c.patch_size} pixels, {c.temporal_patch_size} frames, merge "
                             f"{c.merge_size}) are not the vision tower's ({vision.patch_size}, "
                             f"{vision.temporal_patch_size}, {vision.spatial_merge_size})")
        text = mark - prev
        columns.append(torch.arange(pos, pos + text).expand(3, text))
        pos += text
        ids.extend(input_ids[prev:mark])
        places, pos = image_positions(pos, image.grid_thw, vision.spatial_merge_size)
        columns.append(places)
        items.append(PromptImage(len(ids), image_key(image.digest), image))
        ids.extend([tok] * image.num_tokens)
        prev = mark + 1
    text = len(input_ids) - prev
    columns.append(torch.arange(pos, pos + text).expand(3, text))
    ids.extend(input_ids[prev:])
    positions = torch.cat(columns, dim=1).contiguous()
    return ids, PromptImages(len(ids), items, positions, pos + text - len(ids))
