"""Prefill/decode disaggregation, the worker's side: a generating request sent with the header
``X-Hyla-Prefill-Only: 1`` is only prefilled, and answered with its cached prefix; one sent with
``X-Hyla-Local-Prefill-Tokens: N`` is served only where at most N tokens of its prompt are uncached.

A router in front of prefill and decode workers (``hyla route --prefill-urls``, hyla/router/app.py)
sends a chat, completion, ``/generate`` or Responses request whose prompt is long and new to the decode
worker (below) to a prefill worker with this header. That worker renders and tokenizes the request as it would to serve it (the same endpoint, the
same code up to the engine), computes the prompt (one engine request: one greedy token, the request's
cache namespace and message-boundary checkpoints), and answers with ``/export_prefix``'s bytes for
that prompt (``prefix_response``): the KV of every attention layer and the recurrent state after all
of the prompt's tokens but the last, ``X-Prefix-Tokens`` their number. Where nothing could be kept
(the cache off, a prompt shorter than a page, evicted meanwhile) the answer is a 404
``prefix_not_cached``. The router puts the bytes into a decode worker (``/import_prefix``) and sends it
the request as the client sent it: the decode worker finds the whole prompt but its last token cached,
computes that one, and decodes. KV and state move together, in one body (SGLang's separate channel
for states is this body's state tensors); the decode worker's cache checks both against its own
layout, so the output is what a single server computes.

What the request asks of its output (``n``, ``max_tokens``, logprobs, a grammar, ``stream``) does not
matter here, and nothing is stored (the decode worker makes a Responses request's response). A batch of
different prompts is a 400: one request, one prefix.

Moving a prompt pays only where its prefill is long, so the router first sends the request to the
decode worker with ``X-Hyla-Local-Prefill-Tokens: N``. The worker renders it, asks its own cache
(``Engine.cached_tokens``: the tree, and the host tier) and serves it as usual where at most N of the
prompt's tokens are uncached: a short prompt, a conversation's next turn. Otherwise it answers a 409
``prefill_elsewhere`` before computing anything, with ``X-Hyla-Cached-Tokens``: how many of the prompt's
tokens its device cache holds the KV of. The router has a prefill worker compute the prompt and send
the KV from there on only (``X-Hyla-KV-From``): a conversation's later turn moves its new part's KV
and the state, not its whole history's KV. The decision is the decode worker's, on its cache as it
is, not on the router's picture of it.

A prompt with images moves as any other: each worker reads the request's images (an image URL is fetched by
both: each must list its host), the prefill worker runs the vision tower and computes the prompt, and the prefix
it answers is keyed as the decode worker's cache keys the prompt (each image's tokens named by its digest:
``Req.fill_keys``), so the decode worker's request hits it and runs no tower for the images it covers (a prefix
cut on a page or checkpoint grid over 1 may end inside the last image, which the decode worker embeds).

A request with a LoRA adapter (its ``model`` an adapter's name, ``Job.lora_name``) moves as any other: the
prefill worker computes its prompt with the adapter, and the prefix it answers is in the adapter's cache
namespace (``Engine.export_prefix``'s ``lora_name``: the adapter's content digest), which the decode worker's
requests of the same adapter's files hit. Every worker loads the same adapters (``hyla route`` broadcasts
``/v1/load_lora_adapter`` to them all); a prefill worker without the adapter answers the 404 of an unknown
model, as a decode worker would.

Torch-free at import (the engine's modules are imported where used), so that the router, which runs
without torch, takes the header's name and the answer's from here.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, Sequence

from fastapi import Request
from fastapi.responses import Response

if TYPE_CHECKING:
    from hyla.engine.engine import Engine
    from hyla.server.app import Server
    from hyla.server.generation import Job

PREFILL_ONLY_HEADER = "X-Hyla-Prefill-Only"  # value "1": prefill this request, answer its prefix
LOCAL_PREFILL_HEADER = "X-Hyla-Local-Prefill-Tokens"  # value N: serve only if at most N prompt tokens are uncached
PREFILL_ELSEWHERE = "prefill_elsewhere"  # the error code of the 409 when more are
CACHED_TOKENS_HEADER = "X-Hyla-Cached-Tokens"  # on that 409: the prompt's tokens whose KV the worker's device holds
KV_FROM_HEADER = "X-Hyla-KV-From"  # with PREFILL_ONLY_HEADER: send the KV from this position on only
PREFIX_TOKENS_HEADER = "X-Prefix-Tokens"  # the length of the prefix in an octet-stream answer
PREFIX_NOT_CACHED = "prefix_not_cached"  # the error code of a 404 with no prefix to send
ABORTED_HEADER = "X-Hyla-Aborted"  # value "1": aborted (POST /abort_request) while the router moved its prompt
MAX_HEADER_COUNT = 10**18  # a count header's value past this is read as this (Python refuses int() of 4,301+ digits)


def header_count(value: str | None) -> int | None:
    """A header's count or position (``X-Hyla-*``, ``X-Prefix-Tokens``): its value as an int where it is ASCII
    digits (past ``MAX_HEADER_COUNT``: that), else None (absent, empty, signed, ``"²"``)."""
    if not value or not (value.isascii() and value.isdigit()):
        return None
    return MAX_HEADER_COUNT if len(value) > 18 else int(value)


def _rid_list(value: str) -> set[str]:
    """``ABORTED_HEADER``'s JSON list of rids (the router's: the choices an ``/abort_request`` named while the prompt
    moved); ``APIError`` 400 for another value."""
    from hyla.server.errors import APIError
    try:
        rids = json.loads(value)
    except ValueError:
        rids = None
    if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
        raise APIError(400, f"{ABORTED_HEADER} must be 1 or a JSON list of rids, got {value[:100]!r}")
    return set(rids)


async def disaggregation_answer(server: Server, endpoint: str, jobs: list[Job], arrival: float,
                                request: Request) -> Response | None:
    """A generating endpoint's step between its ``Job``s and ``Server.start_generation``: the answer of a
    prefill-only request (``prefill_answer``); None where the request is to be served as usual; a 409
    ``prefill_elsewhere`` where ``LOCAL_PREFILL_HEADER`` allows fewer uncached prompt tokens than it has
    (a batch's first prompt: the router sends no batch through here). A request sent with ``ABORTED_HEADER``
    (an ``/abort_request`` reached the router while it moved the prompt) is served as one aborted at once:
    its jobs (``1``), or those of the header's JSON list of rids (an abort of some choices), are marked
    ``aborted`` and answer what they produced, nothing, with ``finish_reason`` abort.
    ``endpoint`` and ``arrival`` as ``Server.start_generation`` takes them."""
    from hyla.server.errors import APIError
    from hyla.server.generation import job_request

    aborted = request.headers.get(ABORTED_HEADER)
    if aborted is not None:  # (answered as aborted at once: each job, or those of the JSON list's rids)
        rids = None if aborted == "1" else _rid_list(aborted)
        for job in jobs:
            job.aborted = job.aborted or rids is None or job.rid in rids
        return None  # (a moved request: served here as usual, its prompt imported)
    if request.headers.get(PREFILL_ONLY_HEADER) == "1":
        return await prefill_answer(server, endpoint, jobs, arrival, request)
    value = request.headers.get(LOCAL_PREFILL_HEADER)
    if value is None or isinstance(jobs[0].prompt, str):
        return None
    allowed = header_count(value)
    if allowed is None:
        raise APIError(400, f"{LOCAL_PREFILL_HEADER} must be a number of tokens, got {value!r}")
    job, engine = jobs[0], server.admit()
    try:  # (limit: how far any cached prefix can serve it: all but the last token, or up to its prompt logprobs)
        def counts() -> tuple[Any, int]:  # (and the prompt's length, its images' tokens counted)
            return engine.cached_tokens_by_tier(
                job.prompt, job.namespace, logprob_start_len=job.logprob_start_len, lora_name=job.lora_name,
                image_data=job.image_data), \
                len(engine.prompt_ids(job.prompt, job.image_data) if job.image_data else job.prompt)

        (held, cached, limit), length = await asyncio.to_thread(counts)
        if length - cached <= allowed or cached == limit:
            return None  # (few enough to compute here, or nothing a move could add)
        # a request the engine refuses (prompt + max_tokens past the context, a grammar that does not compile, more
        # choices than it holds) is served as usual, to be refused there: it is not prefilled anywhere first
        await asyncio.to_thread(engine.check_requests, [job_request(j) for j in jobs])
    except ValueError:  # (a bad token id too: the engine's 400 names the endpoint's field)
        return None
    raise APIError(409, f"{length - cached} tokens of this prompt are not cached here (at most {allowed} "
                        "are computed here): prefill it elsewhere", code=PREFILL_ELSEWHERE,
                   headers={CACHED_TOKENS_HEADER: str(held)})


async def prefill_answer(server: Server, endpoint: str, jobs: list[Job], arrival: float, request: Request) -> Response:
    """Compute the prompt of ``jobs`` (one prompt: ``n`` choices share it) and answer its cached
    prefix (``prefix_response``): all of it but the last token, or, for prompt logprobs, up to the first
    position whose logits they need (what the decode worker's cache can serve of the request).
    ``endpoint`` and ``arrival`` as ``Server.start_generation`` takes them."""
    from hyla.engine.cache_manager import new_request_match_limit
    from hyla.server.errors import APIError
    from hyla.server.generation import Job

    if len({(tuple(j.prompt), j.namespace, j.lora_name) for j in jobs}) > 1:
        raise APIError(400, "a prefill-only request takes one prompt, not a batch of different ones",
                       code="batch_not_disaggregated")
    job = jobs[0]
    if isinstance(job.prompt, str):  # /generate's text, left untokenized: the model has no tokenizer
        raise APIError(400, "this model has no tokenizer: send input_ids", param="text")
    # what a cache can serve of the request (prompt logprobs: up to the first position whose logits they need), and
    # the token after it: its prefix is what the decode worker's request will hit (with the images whose placeholder
    # it keeps: one token each in the prompt as given, so no image is cut; where the prompt logprobs start inside an
    # image, the prefix reaches its last token)
    ids = job.prompt[:new_request_match_limit(len(job.prompt), job.logprob_start_len) + 1]
    images = None
    if job.image_data:
        placeholder = server.admit().model_config.vision.image_token_id
        images = job.image_data[:sum(t == placeholder for t in ids)] or None
    prefill = Job(ids, {"max_new_tokens": 1, "temperature": 0.0}, checkpoints=[c for c in job.checkpoints if c < len(ids)],
                  speculative_checkpoints=job.speculative_checkpoints, priority=job.priority, namespace=job.namespace,
                  lora_name=job.lora_name, image_data=images)
    value = request.headers.get(KV_FROM_HEADER, "0")
    kv_from = header_count(value)
    if kv_from is None:
        raise APIError(400, f"{KV_FROM_HEADER} must be a position, got {value!r}")
    gen = await server.start_generation(endpoint, [prefill], arrival)
    await gen.collect(request)
    return await prefix_response(server.admit(), ids, job.namespace, kv_from, job.lora_name, images)


async def prefix_response(engine: Engine, ids: Sequence[int], namespace: Any, kv_from: int = 0,
                          lora_name: str | None = None, image_data: Any = None) -> Response:
    """The cached prefix a request with prompt ``ids`` (applying LoRA adapter ``lora_name``, or none; with
    ``image_data``, its images) would hit (``Engine.export_prefix``; the KV from position ``kv_from`` on), as
    ``application/octet-stream`` (``CachedPrefix.to_bytes``) with its length in ``X-Prefix-Tokens``; a 404
    (``prefix_not_cached``) where nothing is cached. ``ValueError`` for bad ids or namespace."""
    from hyla.server.errors import APIError

    prefix = await asyncio.to_thread(lambda: engine.export_prefix(ids, namespace, kv_from=kv_from,
                                                                  lora_name=lora_name, image_data=image_data))
    if prefix is None:
        raise APIError(404, "no prefix of this prompt is cached", code=PREFIX_NOT_CACHED)
    data = await asyncio.to_thread(prefix.to_bytes)
    return Response(data, media_type="application/octet-stream", headers={PREFIX_TOKENS_HEADER: str(len(prefix))})
