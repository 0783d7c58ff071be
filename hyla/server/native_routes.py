"""SGLang's native API: ``POST /generate``, ``POST /flush_cache``, ``POST /abort_request``,
``GET /get_model_info``, ``GET /get_server_info``, ``GET /health_generate``, and for reinforcement
learning ``POST /update_weights_from_disk`` and ``GET /get_weight_version``; hyla's ``POST
/export_prefix`` and ``POST /import_prefix`` (a cached prefix moved to another server).

A request, top-down: one job per prompt (``text`` or ``input_ids``, one or a list), each with its
own ``sampling_params``, ``rid`` and ``checkpoints`` when lists are given; start them as one
``Generation``; answer ``{"text", "output_ids", "meta_info"}`` per job (a list for a batch). A
stream (single requests only) sends, as SGLang does, the **cumulative** text, ids and meta_info
of the request in each event, then ``[DONE]``.

``/flush_cache`` empties the prefix cache (``Engine.flush_cache``) while no request runs or
waits: ``{"status": "ok"}``, else a 409 (``engine_busy``) and nothing changes. The others: their
methods' docstrings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response

import hyla
from hyla.engine.engine import WEIGHT_UPDATE_SECONDS
from hyla.engine.errors import EngineOverloadedError, RequestError
from hyla.server.disaggregation import disaggregation_answer, prefix_response
from hyla.server.errors import APIError, api_param
from hyla.server.generation import SSE_DONE, Choice, Generation, Job, job_request, json_answer, sse
from hyla.server.protocol import (AbortRequest, ExportPrefixRequest, GenerateRequest, UpdateWeightsFromDiskRequest,
                                  cache_namespace)

if TYPE_CHECKING:
    from hyla.server.app import Server

HEALTH_GENERATE_SECONDS = 20.0  # SGLang's: how long /health_generate waits for the engine
HEALTH_NAMESPACE = "hyla-health-generate"  # its one-token prompts share no prefix with users'


class NativeRoutes:
    """The native endpoints of one ``Server``."""

    def __init__(self, server: Server):
        self.server = server
        # weight updates one at a time, in arrival order, waiting here (not on a thread of the event loop's pool:
        # updates that wait for the running requests or for each other took every one, and every endpoint that
        # parses or renders off the loop hung behind them)
        self._update_turn = asyncio.Lock()

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/generate")(self.generate)
        router.post("/flush_cache")(self.flush_cache)
        router.post("/abort_request")(self.abort_request)
        router.get("/get_model_info")(self.get_model_info)
        router.get("/get_server_info")(self.get_server_info)
        router.get("/health_generate")(self.health_generate)
        router.post("/update_weights_from_disk")(self.update_weights_from_disk)
        router.get("/get_weight_version")(self.get_weight_version)
        router.post("/export_prefix")(self.export_prefix)
        router.post("/import_prefix")(self.import_prefix)
        return router

    async def _tokenized(self, jobs: list[Job]) -> list[Job]:
        """Text prompts tokenized here, on a worker thread after the prompt cap, as the engine would
        (a model without a tokenizer: left to the engine, which refuses text)."""
        texts = [job.prompt for job in jobs if isinstance(job.prompt, str)]
        tokenizer = self.server.admit().tokenizer
        if not texts or tokenizer is None:
            return jobs
        encoded = iter(await self.server.encode_texts(tokenizer, texts, "text"))
        return [replace(job, prompt=next(encoded)) if isinstance(job.prompt, str) else job for job in jobs]

    async def generate(self, body: GenerateRequest, request: Request) -> Response:
        arrival = time.monotonic()
        jobs = _jobs(body)
        self._check_loras(body, jobs)
        jobs = await self._tokenized(jobs)
        try:
            answer = await disaggregation_answer(self.server, "generate", jobs, arrival, request)
            if answer is not None:
                return answer
            gen = await self.server.start_generation("generate", jobs, arrival)
        except APIError as exc:
            if exc.status == 400:
                exc.param = await self._body_param(exc.param, body, jobs)
            raise
        if body.stream:
            return gen.stream(_events(gen))
        collected = await gen.collect(request)
        return await json_answer(lambda: _output(collected[0]) if body.is_single() else [_output(c) for c in collected])

    def _check_loras(self, body: GenerateRequest, jobs: list[Job]) -> None:
        """A 400 naming ``lora_path`` (its item's index, for a list) where a job names a LoRA adapter that is
        not loaded (SGLang's field holds the adapter's name)."""
        names = {job.lora_name for job in jobs} - {None}
        if not names:
            return
        adapters = self.server.lora_adapters()
        for i, job in enumerate(jobs):
            self._check_lora(job.lora_name, f"lora_path.{i}" if isinstance(body.lora_path, list) else "lora_path",
                             adapters)

    def _check_lora(self, name: str | None, param: str, adapters: dict[str, str] | None = None) -> None:
        """A 400 naming ``param`` where ``name`` (None: none) is no LoRA adapter loaded (``adapters``: those
        loaded, where the caller has them)."""
        if name is None:
            return
        adapters = self.server.lora_adapters() if adapters is None else adapters
        if name not in adapters:
            loaded = ", ".join(map(repr, sorted(adapters))) or "none"
            raise APIError(400, f"the LoRA adapter {name!r} is not loaded (loaded: {loaded}; POST "
                                "/v1/load_lora_adapter loads one)", param=param, code="lora_adapter_not_found")

    async def _body_param(self, param: str | None, body: GenerateRequest, jobs: list[Job]) -> str | None:
        """The body's field for a refused request's ``param`` (``api_param``'s, for the engine's
        request): the prompt is ``text`` where the body sent text (tokenized here); a field the body
        gives per prompt of a batch (a list: ``_listed_fields``) gets the index of the item at fault,
        ``sampling_params.1.temperature`` (the first job the engine refuses for that field)."""
        if param is None:
            return None
        head, dot, rest = param.partition(".")
        if head in ("input_ids", "prompt") and body.text is not None:
            head = "text"
        if head in _listed_fields(body):
            index = await asyncio.to_thread(self._refused_job, jobs, param)
            head = head if index is None else f"{head}.{index}"
        return head + dot + rest

    def _refused_job(self, jobs: list[Job], param: str) -> int | None:
        """The index of the first of ``jobs`` the engine refuses (``Engine.check_requests``: what submitting
        it checks, nothing submitted), where it names ``param``; else None. For an error's path only."""
        engine = self.server.admit()
        for i, job in enumerate(jobs):
            try:
                engine.check_requests([job_request(job)])
            except ValueError as exc:
                refused = api_param(exc.param, "generate") if isinstance(exc, RequestError) else None
                return i if refused == param else None
        return None

    async def flush_cache(self) -> Response:
        engine = self.server.admit()
        if not await asyncio.to_thread(engine.flush_cache):
            raise APIError(409, "the cache was not flushed: requests are running or waiting (retry when the "
                                "server is idle)", code="engine_busy")
        return JSONResponse({"status": "ok", "message": "cache flushed"})

    async def abort_request(self, body: AbortRequest) -> Response:
        """Abort the request ``rid`` (as given to ``/generate``: an unknown or finished one is left
        alone), or every live one with ``abort_all``. An aborted request's client gets what it produced
        so far, ``finish_reason`` abort (cause ``client``)."""
        engine = self.server.admit()
        if body.abort_all:
            engine.abort_all()
        else:
            engine.abort(body.rid)
        return JSONResponse({"status": "ok"})

    async def update_weights_from_disk(self, body: UpdateWeightsFromDiskRequest) -> Response:
        """Serve another checkpoint of the same model (``Engine.update_weights_from_disk``: running
        requests finish on the old weights, or are aborted with ``abort_all_requests``; new ones wait
        meanwhile). SGLang's answer, ``{"success", "message", "num_paused_requests"}``, with
        ``weight_version``; a checkpoint of another model is a 400 (``param`` model_path), running
        requests that do not finish in ten minutes a 409 (``engine_busy``), an update that failed on
        the server's side (the weights left inconsistent: ``RuntimeError``) a 500
        (``weight_update_failed``), the body's ``success`` false in all three. Updates run one at a time in
        the order they came, each waiting for its turn here, holding no thread."""
        engine = self.server.admit()
        start = time.monotonic()  # (the ten minutes count from here: the turn's wait, the drain, the read)
        try:
            try:
                await asyncio.wait_for(self._update_turn.acquire(), WEIGHT_UPDATE_SECONDS)
            except asyncio.TimeoutError:
                raise TimeoutError(f"another weight update still running after {WEIGHT_UPDATE_SECONDS:g} s: the "
                                   "weights were not updated") from None
            try:
                left = max(0.001, WEIGHT_UPDATE_SECONDS - (time.monotonic() - start))
                done = await asyncio.to_thread(engine.update_weights_from_disk, body.model_path,
                                               abort_all_requests=body.abort_all_requests,
                                               weight_version=body.weight_version, timeout=left)
            finally:
                self._update_turn.release()
        except ValueError as exc:
            raise WeightUpdateFailed(400, f"the weights were not updated: {exc}", param="model_path") from None
        except TimeoutError as exc:
            raise WeightUpdateFailed(409, str(exc), code="engine_busy") from None
        except RuntimeError as exc:  # (logged by the engine: the served checkpoint failed the read back, a shutdown)
            raise WeightUpdateFailed(500, f"the weight update failed: {exc}", type="internal_error",
                                     code="weight_update_failed") from None
        return JSONResponse({"success": True, "message": f"updated the weights from {done['model_path']} in "
                                                         f"{done['seconds']:.1f} s",
                             "num_paused_requests": 0, "num_aborted_requests": done["num_aborted_requests"],
                             "weight_version": done["weight_version"]})

    async def export_prefix(self, body: ExportPrefixRequest) -> Response:
        """The cached prefix a request with the body's prompt would hit, with its KV and the state after
        it (``Engine.export_prefix``), as ``application/octet-stream`` bytes (``CachedPrefix.to_bytes``)
        with its length in ``X-Prefix-Tokens``; a 404 (``prefix_not_cached``) where nothing is cached.
        For another server of the same model: ``/import_prefix``."""
        engine = self.server.admit()
        self._check_lora(body.lora_path, "lora_path")
        ids = body.input_ids
        if body.text is not None:
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send input_ids", param="text")
            (ids,) = await self.server.encode_texts(engine.tokenizer, [body.text], "text")
        try:
            return await prefix_response(engine, ids, cache_namespace(body.cache_salt), body.kv_from, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="text" if body.text is not None else "input_ids") from None

    async def import_prefix(self, request: Request) -> Response:
        """Put a cached prefix of another server of the same model (``/export_prefix``'s bytes, the
        body) into this server's prefix cache (``Engine.import_prefix``): ``{"cached_tokens",
        "prefix_tokens"}``, ``cached_tokens`` what the cache holds of it now (all of it, or where no
        room could be made beside the running requests, what it held before). Bytes that are not a
        prefix, or a prefix of another model or cache layout, are a 400. The body may be as large as
        ``--max-prefix-bytes``. The prefix is trusted as this model's computation: serve with an API key."""
        engine = self.server.admit()
        data = await request.body()
        try:
            prefix = await asyncio.to_thread(engine.read_prefix, data)
            cached = await asyncio.to_thread(engine.import_prefix, prefix)
        except ValueError as exc:
            raise APIError(400, f"the prefix was not imported: {exc}", code="invalid_prefix") from None
        return JSONResponse({"cached_tokens": cached, "prefix_tokens": len(prefix)})

    async def get_weight_version(self) -> Response:
        """``{"weight_version"}``: the name of the weights served (also in ``/get_model_info``)."""
        return JSONResponse({"weight_version": self.server.admit().weight_version})

    async def get_model_info(self) -> Response:
        """What is served (SGLang's fields, and the context length and vocabulary size)."""
        engine = self.server.admit()
        return JSONResponse({
            "model_path": str(engine.model_path), "served_model_name": self.server.model_name,
            "tokenizer_path": str(engine.tokenizer_path) if engine.tokenizer_path is not None else None,
            "is_generation": True, "preferred_sampling_params": engine.sampling_defaults or None,
            "context_length": engine.context_length, "vocab_size": engine.model_config.vocab_size,
            "weight_version": engine.weight_version})

    async def get_server_info(self) -> Response:
        """The engine's options as resolved (``EngineArgs``), the sizes it chose, the output parsers in use
        (``tool_call_parser``: the syntax ``auto`` chose; ``reasoning_parser``, null when off), and its
        counters (``get_stats``: SGLang's ``internal_states``)."""
        engine = self.server.admit()
        args = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(engine.args).items()}
        reasoning = self.server.reasoning_parser
        return JSONResponse(jsonable_encoder({
            "version": hyla.__version__, "served_model_name": self.server.model_name, "engine_args": args,
            "tool_call_parser": self.server.tool_call_parser.name,
            "reasoning_parser": reasoning.name if reasoning is not None else None,
            "max_running_requests": engine.max_running_requests, "context_length": engine.context_length,
            "max_total_num_tokens": engine.kv_pool.size, "max_state_slots": engine.state_pool.size,
            "internal_states": [engine.get_stats()]}))

    async def health_generate(self) -> Response:
        """A health check through the engine (SGLang's): 200 once a one-token request has been
        generated — or, when the queue is full or the request waited behind others, once the engine
        has made any progress — within ``HEALTH_GENERATE_SECONDS``, else 503 ``engine_stalled``.
        (``/health`` answers without the engine: it says the server admits requests, not that the
        scheduler moves.)"""
        engine = self.server.admit()

        def progress() -> tuple[int, int]:
            stats = engine.get_stats()
            return stats["num_generated_tokens"], stats["num_requests_finished"]

        before, deadline = progress(), time.monotonic() + HEALTH_GENERATE_SECONDS
        try:
            await asyncio.wait_for(engine.async_generate(input_ids=[0], namespace=HEALTH_NAMESPACE,
                                                         sampling_params={"max_new_tokens": 1, "temperature": 0}),
                                   HEALTH_GENERATE_SECONDS)
            return JSONResponse({"status": "ok"})
        except EngineOverloadedError:  # busy, not necessarily stalled: healthy if anything moves
            while time.monotonic() < deadline:
                if progress() != before:
                    return JSONResponse({"status": "ok"})
                await asyncio.sleep(0.05)
        except asyncio.TimeoutError:  # (async_generate aborted its request on the cancellation); a long
            if progress() != before:  # queue ahead of it, not a stall, when other requests moved meanwhile
                return JSONResponse({"status": "ok"})
        raise APIError(503, f"the engine generated nothing within {HEALTH_GENERATE_SECONDS:g} s",
                       type="service_unavailable", code="engine_stalled")


class WeightUpdateFailed(APIError):
    """A failed weight update's error: the OpenAI-style body, with SGLang's ``success`` and ``message``."""

    def body(self) -> dict[str, Any]:
        return {**super().body(), "success": False, "message": self.message}


def _output(choice: Choice) -> dict[str, Any]:
    return {"text": choice.text, "output_ids": choice.output_ids, "meta_info": choice.meta_info()}


async def _events(gen: Generation) -> AsyncIterator[str]:
    async for choice, _ in gen.events():
        yield sse(_output(choice))
    yield SSE_DONE


def _listed_fields(body: GenerateRequest) -> set[str]:
    """The fields ``body`` gives one value per prompt of a batch (lists, item ``i`` for prompt ``i``): the
    prompts of a batch themselves, and ``sampling_params``, ``rid``, ``logprob_start_len``, ``priority``,
    ``lora_path`` given as lists and ``checkpoints`` as a list of lists."""
    listed = {name for name in ("sampling_params", "rid", "logprob_start_len", "priority", "lora_path")
              if isinstance(getattr(body, name), list)}
    if not body.is_single():
        listed.add("text" if body.text is not None else "input_ids")
    if body.checkpoints and not isinstance(body.checkpoints[0], int):
        listed.add("checkpoints")
    return listed


def _sglang_names(p: dict[str, Any], where: str) -> dict[str, Any]:
    """SGLang's sampling fields the engine names otherwise or has no use for, as SGLang's own frontend sends
    them (``sglang.lang``'s ``to_srt_kwargs``): ``no_stop_trim`` is ``include_stop_str_in_output``;
    ``spaces_between_special_tokens`` changes nothing (a fast tokenizer's decode adds none either way); ``n``
    of 1 and an empty ``stop_regex`` ask for nothing. ``n`` above 1 and a ``stop_regex`` are a 400."""
    if "no_stop_trim" in p:
        trim = p.pop("no_stop_trim")
        if trim is not None:
            if p.setdefault("include_stop_str_in_output", trim) != trim:
                raise APIError(400, "no_stop_trim and include_stop_str_in_output differ", param=f"{where}.no_stop_trim")
    spaces = p.pop("spaces_between_special_tokens", None)
    if spaces is not None and not isinstance(spaces, bool):
        raise APIError(400, f"spaces_between_special_tokens must be a bool, got {spaces!r}",
                       param=f"{where}.spaces_between_special_tokens")
    n = p.pop("n", None)
    if n is not None and (isinstance(n, bool) or n != 1):
        raise APIError(400, f"n must be 1 here, got {n!r}: send the prompt n times (a list of prompts)",
                       param=f"{where}.n")
    if p.pop("stop_regex", None):
        raise APIError(400, "stop_regex is not supported: use stop (strings) or a regex grammar",
                       param=f"{where}.stop_regex")
    return p


def _jobs(body: GenerateRequest) -> list[Job]:
    """One job per prompt; per-item lists (sampling_params, rid, checkpoints) must match the batch, and
    a batch's ``rid`` is a list (SGLang's rule: one id each, all different)."""
    prompts: list[str | list[int]]
    if body.text is not None:
        prompts = [body.text] if isinstance(body.text, str) else list(body.text)
    else:
        prompts = [body.input_ids] if body.is_single() else list(body.input_ids)
    n = len(prompts)
    if n == 0:
        raise APIError(400, "no request given: text or input_ids is an empty list")
    listed = _listed_fields(body)

    def per_item(name: str) -> list[Any]:
        value = getattr(body, name)
        if name not in listed:
            return [value] * n
        if len(value) != n:
            raise APIError(400, f"{name} has {len(value)} entries for {n} requests", param=name)
        return list(value)

    params = per_item("sampling_params")
    starts = per_item("logprob_start_len")
    if isinstance(body.rid, str) and n > 1:  # (the engine would see one id for every request: "in use")
        raise APIError(400, f"rid is one id for a batch of {n} requests: a batch needs a list of rids, one per "
                            "prompt", param="rid")
    if isinstance(body.rid, list) and len(set(body.rid)) < len(body.rid):
        raise APIError(400, "rid lists an id twice: each request of a batch needs its own", param="rid")
    rids = per_item("rid")
    priorities = per_item("priority")
    loras = per_item("lora_path")
    single_ckpt = "checkpoints" not in listed
    if body.checkpoints and n > 1 and single_ckpt:
        raise APIError(400, "checkpoints must be a list of lists for a batch", param="checkpoints")
    ckpts = [body.checkpoints or []] if single_ckpt else per_item("checkpoints")
    ckpts = ckpts * n if len(ckpts) == 1 else ckpts
    jobs = []
    for k, (prompt, p, rid, ck, start, prio, lora) in enumerate(zip(prompts, params, rids, ckpts, starts, priorities,
                                                                  loras)):
        p = _sglang_names(dict(p or {}), f"sampling_params.{k}" if "sampling_params" in listed else "sampling_params")
        if body.top_logprobs_num is not None:
            p.setdefault("top_logprobs_num", body.top_logprobs_num)
        jobs.append(Job(prompt, p, return_logprob=body.return_logprob, checkpoints=list(ck), rid=rid,
                        logprob_start_len=start, speculative_checkpoints=body.speculative_checkpoints, priority=prio,
                        namespace=cache_namespace(body.cache_salt), lora_name=lora))
    return jobs
