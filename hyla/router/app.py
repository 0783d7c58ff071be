"""The router's HTTP app: one address in front of data-parallel ``hyla serve`` workers.

    hyla route --worker-urls http://gpu0:30000 http://gpu1:30000 --port 30100

Every request is forwarded as it came (method, path, query, body, the client's ``Authorization``)
to one worker, and the worker's answer comes back as it is, a stream chunk by chunk. Which worker:

* ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``, ``/v1/responses``: the policy
  (``policy.Router``: cache-aware by default) on the request's routing key (``routing_key``);
* ``/v1/responses`` (and ``/v1/responses/input_tokens``) with a ``conversation`` (else a
  ``previous_response_id``, else an ``item_reference``, whose id names its response), ``/v1/responses/{id}...``
  and ``/v1/conversations/{id}...``: the worker that made that response or conversation (it alone stores it):
  the router reads each response's and conversation's id as it passes (a stream's from its first event), and
  asks each worker in turn for one it did not see made;
* ``POST /flush_cache``, ``/abort_request``, ``/update_weights_from_disk``, ``/v1/load_lora_adapter``,
  ``/v1/unload_lora_adapter``: every healthy worker (the answer is the first failure's, or the first
  worker's; ``/flush_cache`` also clears the tables of the workers that flushed; a weight update and an
  adapter's load need every worker healthy);
* ``POST /export_prefix``: every healthy worker; the answer is the longest prefix any holds (its
  ``X-Prefix-Tokens``), else the first worker's answer (a 404 when none holds one);
* anything else (``/v1/models``, ``/tokenize``, ``/get_model_info``, ``/import_prefix``...): the least
  loaded worker.

The router's own: ``GET /health`` (200 while a worker is healthy, else 503), ``GET /workers`` (each
worker's URL, health, requests in flight, requests routed and table size; the prefill workers apart) and ``GET /metrics``
(Prometheus). With ``api_key`` (``hyla route --api-key``) every path but ``/health`` and ``/metrics``
needs ``Authorization: Bearer <key>`` (the workers' rule, ``hyla.server.auth``), else a 401 that reaches
no worker; the header is forwarded as it came, so workers started with the same key accept it.

**Prefill/decode disaggregation** (``prefill_urls``: ``hyla route --prefill-urls``): the workers above
then decode, and the prefill workers compute prompts. A routed request (not a batch of prompts, not
one that reads a stored response) goes to the decode worker the policy picks, with
``X-Hyla-Local-Prefill-Tokens: local_prefill_tokens``: the worker serves it where at most that many
tokens of its prompt are uncached there (a short prompt, a conversation's next turn), else answers a
409 ``prefill_elsewhere`` having computed nothing, saying how many of the prompt's tokens it holds the
KV of. Then the request goes to a prefill worker (the policy over the prefill workers' own tables)
with ``X-Hyla-Prefill-Only: 1`` and ``X-Hyla-KV-From`` (that count); its answer is the prompt's cached
prefix, the recurrent state and the KV the decode worker lacks (``hyla/server/disaggregation.py``). The router posts
those bytes to a decode worker (``/import_prefix``), then sends it the request as it came: the worker
finds all of the prompt but its last token cached, so long prompts no longer stall its running decodes.
Whatever goes wrong on the way costs only the saving, never the request: no prefill worker healthy,
one that fails (it turns unhealthy; the next is tried), nothing to export (a prompt shorter than a
page), an import refused: the decode worker prefills the prompt itself. A prefill worker's client
error (a 4xx: the decode worker would refuse the request as well) is the client's answer. An
``/abort_request`` that arrives while a prompt moves (its ``rid``, or ``abort_all``) reaches no worker that
knows the request: the router keeps it (``Move``), stops the prefill (closing its connection aborts it
there), skips the import, and sends the request to the decode worker with ``X-Hyla-Aborted: 1``, which
answers it as aborted at once (nothing produced); an abort of some of its choices sends their rids in the
header (a JSON list), the prompt moved as usual. Broadcasts,
``/export_prefix`` and health checks include the prefill workers; every other path goes to the
decode workers only.

A worker is healthy until it fails a request, answers a 503, or its ``/health`` does not answer 200
(checked every ``health_interval`` seconds, and at start-up); then it gets no requests until a check
passes again. A worker that restarted (a new ``instance_id`` in its ``/health``) stays unhealthy while the
router sends it again the last weight update and the adapters loaded since (``broadcast_state``). A request the worker fails before answering (no connection, a reset), or refuses with
a 503, is sent to another worker (each at most once); with none left the client gets a 503 with an
OpenAI-style body (Anthropic's on ``/v1/messages``, as the router's own 401, 404 and 413) (or, where no other worker is healthy, the 503 of the last one tried). A 429 (the
worker's waiting queue is full) sends the request to another worker too, the first staying healthy; the
client gets the 429 when no worker is left to try, or when the request reads a stored response that only
that worker holds. A stream passes on whole events only, so a worker failing mid-stream (mid-event) ends it
with no half event: then an error event and ``[DONE]``, or a Responses stream's ``error`` and
``response.failed`` events (``_EventCut``). A worker silent for ``read_timeout`` seconds on a forwarded
request (before its answer, or mid-stream; none by default) has failed it, as one whose connection breaks.
A body over ``max_request_bytes`` is a 413 and reaches no
worker. A client that disconnects (from a stream, while waiting for a whole answer, or before its body is
whole) closes the worker's request, which aborts it there, or reaches no worker.
The router keeps no model and imports no torch: it runs anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import logging
import re
import secrets
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.requests import ClientDisconnect

from hyla.router.policy import (DEFAULT_LOCAL_PREFILL_TOKENS, DEFAULT_POLICY, MAX_KEY_BLOCKS, Namespaced,
                               PrefixTable, Router)
from hyla.server.auth import API_KEY_MESSAGE, bearer_key_matches
from hyla.server.cors import add_cors
from hyla.server.error_bodies import anthropic_error_body, is_anthropic_path, openai_error_body
from hyla.server.disaggregation import (ABORTED_HEADER, CACHED_TOKENS_HEADER, KV_FROM_HEADER, LOCAL_PREFILL_HEADER,
                                       PREFILL_ELSEWHERE, PREFILL_ONLY_HEADER, PREFIX_NOT_CACHED, PREFIX_TOKENS_HEADER,
                                       header_count)
from hyla.server.responses_protocol import item_type, response_of_item, typed_event

logger = logging.getLogger("hyla.router")

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses", "/v1/messages")
PROMPT_PATHS = ("/v1/completions", "/generate")  # the routed paths whose prompt may be a batch of prompts
BROADCAST_PATHS = ("/flush_cache", "/abort_request", "/update_weights_from_disk", "/v1/load_lora_adapter",
                   "/v1/unload_lora_adapter")
# broadcasts a worker that is down misses for good (it would serve without them once back): all or none
ALL_WORKERS_PATHS = ("/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# the longest a worker may take to answer a broadcast before it has failed it (a worker hung there would hold the
# operator's request forever): an abort is answered at once, a flush waits for the engine to be idle (60 s at
# most, Engine.flush_cache); loading weights takes as long as the checkpoint does (no limit)
BROADCAST_SECONDS = {"/abort_request": 30.0, "/flush_cache": 120.0}
# request headers a worker needs; hop-by-hop ones (Connection, Content-Length: httpx sets it) are not forwarded
FORWARDED_REQUEST_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "user-agent", "x-request-id")
# response headers of the worker's connection, and those the router's own server writes (date, server)
DROPPED_RESPONSE_HEADERS = ("content-length", "transfer-encoding", "connection", "keep-alive", "date", "server")
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"((?:resp|conv)_[0-9A-Za-z]+)"')  # a response's or a conversation's
# what a worker stores, and where the router asks a worker whether it does (by the id's prefix)
STORED_PATHS = {"resp_": "/v1/responses/", "conv_": "/v1/conversations/"}
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # as a worker's default (hyla serve --max-request-bytes): a larger body is a 413
OWNER_LOOKUP_SECONDS = 5.0  # how long a worker may take to say whether it stores a response
PARSE_IN_THREAD_BYTES = 1 << 16  # a body this large is parsed off the event loop (1 MiB of tiny list items: ~0.5 s)
MAX_REMEMBERED_RESPONSES = 100_000  # response id -> its worker, least recently made dropped first


def error_body(message: str, type: str = "service_unavailable", code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return openai_error_body(message, type, code=code)


def error_response(path: str, status: int, message: str, type: str = "service_unavailable", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The router's own answer to a request for ``path``: OpenAI's error body, or Anthropic's on Anthropic's
    paths (its SDK reads that shape), as a worker answers (``errors.APIError.response``)."""
    body = anthropic_error_body(status, message) if is_anthropic_path(path) else error_body(message, type, code)
    return JSONResponse(body, status_code=status, headers=headers)


def routing_key(path: str, body: Any, base_model: str | None = None) -> str | list[int] | Namespaced | None:
    """:func:`prompt_key` in the namespace of the model the request names (``model``; ``/generate``'s
    ``lora_path``): the workers cache each LoRA adapter's prompts apart (``policy.Namespaced``). The served model
    (``base_model``, the name the workers' ``/health`` gives) is no adapter: its requests keep their keys, as
    those naming no model do (a ``/generate`` without ``lora_path``), whose prompts the workers cache alike."""
    key = prompt_key(path, body)
    model = body.get("lora_path" if path == "/generate" else "model") if isinstance(body, dict) else None
    if isinstance(model, list) and model:  # (a batch's, one per prompt: by its first, as its key)
        model = model[0]
    named = key is not None and isinstance(model, str) and model and model != base_model
    return Namespaced(model, key) if named else key


def prompt_key(path: str, body: Any) -> str | list[int] | None:
    """What a request is routed by: its prompt as the client sent it (the module docstring of
    ``policy``), at most its first ``MAX_KEY_BLOCKS`` blocks and a little more, or None where it has
    none the router can read (the worker answers such a request; the router only picks where). A chat's
    or a Responses turn's ``prompt_cache_key`` comes first: requests with the same key and prompt prefix
    go together, and requests of other keys go by load though their prompts begin alike (the agents of
    one framework share a long system prompt and tools; each conversation then keeps its worker)."""
    if not isinstance(body, dict):
        return None
    cap = MAX_KEY_BLOCKS * 64 + 64
    hint = body.get("prompt_cache_key")  # (OpenAI's: the requests that share a cache say so; a chat's, a turn's)
    hint = f"prompt_cache_key={json.dumps(hint)}\n" if isinstance(hint, str) and hint else ""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        tools = body.get("tools")
        return _list_key(hint + (json.dumps(tools, sort_keys=True) if tools else ""), messages, cap)
    if path == "/v1/messages":  # (Anthropic's: the system prompt and the tools, then the turns)
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        tools = body.get("tools")
        return _list_key(json.dumps(body.get("system")) + (json.dumps(tools, sort_keys=True) if tools else ""),
                         messages, cap)
    if path == "/v1/responses":
        given = body.get("input")
        return _list_key(hint + json.dumps(body.get("instructions")), given if isinstance(given, list) else [given],
                         cap)
    if path not in PROMPT_PATHS:
        return None
    prompt = _prompt_field(path, body)
    if _is_prompt_list(prompt):
        prompt = prompt[0]  # a batch: by its first prompt
    if isinstance(prompt, str):
        return prompt[:cap]
    if isinstance(prompt, list):
        ids = prompt[:cap]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
    return None


def _prompt_field(path: str, body: dict) -> Any:
    """The prompt of a ``PROMPT_PATHS`` request as sent: a completion's ``prompt``, ``/generate``'s
    ``text`` or else its ``input_ids``."""
    if path == "/v1/completions":
        return body.get("prompt")
    return body.get("text") if body.get("text") is not None else body.get("input_ids")


def _is_prompt_list(prompt: Any) -> bool:
    """Whether a prompt field holds a list of prompts (texts, or lists of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def is_batch(path: str, body: Any) -> bool:
    """Whether a routed request holds more than one prompt (a completion's or ``/generate``'s list)."""
    if not isinstance(body, dict) or path not in PROMPT_PATHS:
        return False
    prompts = _prompt_field(path, body)
    return _is_prompt_list(prompts) and len(prompts) > 1


def _list_key(head: str, items: list, cap: int) -> str:
    """``head`` then ``json.dumps(items)`` but for its closing bracket (so that the key of a list that
    later grows is a prefix of the longer list's key), serialized item by item only up to ``cap``
    characters."""
    key = head + "["
    for i, item in enumerate(items):
        if len(key) > cap:
            break
        key += (", " if i else "") + json.dumps(item, sort_keys=True)
    return key[:cap]


def check_worker_urls(worker_urls: Sequence[str]) -> list[str]:
    """The workers' base URLs without a trailing slash; ``ValueError`` for none, one that is not
    http(s), or one given twice."""
    urls = [u.rstrip("/") for u in worker_urls]
    if not urls:
        raise ValueError("the router needs a worker URL at least")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a worker URL is given twice: {urls}")
    return urls


def _conversation_id(conversation: Any) -> str | None:
    """A Responses request's ``conversation``: its id, given as itself or as ``{"id": ...}``; None otherwise."""
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    return conversation if isinstance(conversation, str) else None


def _referenced_response(items: Any) -> str | None:
    """The response of the first ``item_reference`` among a Responses request's ``input`` items
    (``responses_protocol.item_type``) whose id names one, else None."""
    for item in items if isinstance(items, list) else ():
        if isinstance(item, dict) and item_type(item) == "item_reference" and isinstance(item.get("id"), str):
            found = response_of_item(item["id"])
            if found is not None:
                return found
    return None


def _parse(raw: bytes, path: str, base_model: str | None = None) -> tuple[Any, str | list[int] | None]:
    """A request body's JSON (None where it is not JSON: the worker answers that) and its routing key."""
    try:
        body = json.loads(raw) if raw else None
        return body, routing_key(path, body, base_model)
    except (ValueError, RecursionError):  # (not JSON, or nested past Python's recursion limit)
        return None, None


def _abort_target(raw: bytes) -> tuple[str | None, bool] | None:
    """What an ``/abort_request`` body aborts, the workers' rule (``{"rid": ...}`` or ``{"abort_all": true}``):
    ``(rid, False)`` or ``(None, True)``; None for a body the workers refuse."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    rid, everyone = body.get("rid") or None, body.get("abort_all") is True
    if everyone == (rid is not None) or not (everyone or isinstance(rid, str)):
        return None
    return rid, everyone


def _error_code(data: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-style error body, or None."""
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _headers(response: Response, upstream: httpx.Response, head: bool = False) -> Response:
    """``response`` with the worker's headers as they came (their bytes: a value outside latin-1 passes through),
    each as many times (``set-cookie``), but those of the connection and those the router's server writes itself.
    The answer to a ``HEAD`` (``head``) keeps the worker's ``Content-Length``: the length of what a GET would get."""
    own = [(k, v) for k, v in response.raw_headers if k == b"content-length" and not head]  # (of a body it holds)
    response.raw_headers = own + [(k.lower(), v) for k, v in upstream.headers.raw
                                  if k.lower().decode("latin-1") not in DROPPED_RESPONSE_HEADERS
                                  or (head and k.lower() == b"content-length")]
    return response


def _broadcast_key(path: str, raw: bytes) -> Any:
    """What a weight update or an adapter's load or unload sets on a worker: ``"weights"``, or ``("lora", name)``
    (a later broadcast of the same key replaces it); None for a body naming no adapter."""
    if path == "/update_weights_from_disk":
        return "weights"
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        name = json.loads(raw).get("lora_name")
        if isinstance(name, str):
            return ("lora", name)
    return None


def _safe_path(path: str) -> bool:
    """Whether a request path may be put after a worker's URL as it is: no control characters (httpx refuses
    them) and no ``.`` or ``..`` segment (httpx would resolve it: ``/v1/../update_weights_from_disk`` would reach
    one worker, not the broadcast)."""
    return not any(c < " " or c == "\x7f" for c in path) and not ({".", ".."} & set(path.split("/")))


RESPONSE_ID_FORM = re.compile(r"[A-Za-z0-9_-]{1,256}")  # a stored response's id the router looks up (resp_<hex>)


@dataclass
class Worker:
    url: str
    healthy: bool = True
    in_flight: int = 0  # requests forwarded whose answer has not been delivered whole
    routed: int = 0  # requests forwarded in all
    cache_id: str | None = None  # its /health's cache_id when last seen (a new one: its cache was emptied)
    instance_id: str | None = None  # its /health's instance_id when last seen (a new one: it restarted)
    # broadcasts it lacks — all of them after a restart, or one it failed while the others took it — (path, body,
    # headers) in order: unhealthy until it took them (None: it lacks none)
    owed: list[tuple[str, bytes, dict]] | None = None
    reachable: bool = True  # its last health check answered 200 (an owing worker is unhealthy but reachable)
    replay: asyncio.Task | None = None  # sending them now


class OwnerUnavailable(Exception):
    """The worker holding a stored response or conversation (``owner``) cannot take a request that reads it."""

    def __init__(self, owner: int) -> None:
        super().__init__(owner)
        self.owner = owner


@dataclass(eq=False)
class Move:
    """A routed request whose prompt a prefill worker computes for its decode worker, from the decode
    worker's 409 until the request is sent to it: no worker knows the request meanwhile, so an
    ``/abort_request`` for it (its ``rid``, or ``abort_all``) is kept here (``RouterApp.note_abort``)."""

    # the request's own rids (a body's ``rid``: a string, or one per choice or prompt, on /generate and the OpenAI
    # endpoints alike); none given, only abort_all reaches it
    rids: frozenset[str] = frozenset()
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # all of it (abort_all, or every rid): no prefill
    aborted_rids: set[str] = field(default_factory=set)  # some of its choices (their rids), told to the worker


class RouterApp:
    """The state behind the app: the workers, the policy, the HTTP client, the metrics."""

    def __init__(self, worker_urls: Sequence[str], router: Router, health_interval: float = 5.0,
                 connect_timeout: float = 5.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_key: str | None = None, prefill_urls: Sequence[str] = (),
                 prefill_router: Router | None = None, local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS,
                 read_timeout: float | None = None) -> None:
        urls = check_worker_urls(worker_urls)
        prefill_urls = check_worker_urls(list(worker_urls) + list(prefill_urls))[len(urls):]
        if len(router.tables) != len(urls):
            raise ValueError(f"the policy has {len(router.tables)} workers, the URLs {len(urls)}")
        if prefill_urls and (prefill_router is None or len(prefill_router.tables) != len(prefill_urls)):
            raise ValueError(f"the prefill policy must have {len(prefill_urls)} workers")
        if local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be >= 0, got {local_prefill_tokens}")
        self.local_prefill_tokens = local_prefill_tokens
        if not health_interval > 0 or not connect_timeout > 0:
            raise ValueError(f"health_interval and connect_timeout must be > 0, got {health_interval}, {connect_timeout}")
        if read_timeout is not None and not 0 < read_timeout < float("inf"):
            raise ValueError(f"read_timeout must be > 0 seconds (or None: no limit), got {read_timeout}")
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.workers = [Worker(u) for u in urls]
        self.router = router
        self.prefill_workers = [Worker(u) for u in prefill_urls]
        self.prefill_router = prefill_router
        self.health_interval = health_interval
        # no read timeout by default: a long generation streams for minutes; connecting is what fails fast
        self.timeout = httpx.Timeout(None, connect=connect_timeout)
        # a forwarded request's: the longest a worker may send nothing (before its answer, or between two chunks
        # of a stream) before it has failed the request (broadcasts, owner lookups and imports have their own)
        self.request_timeout = httpx.Timeout(None, connect=connect_timeout, read=read_timeout)
        self.client: httpx.AsyncClient | None = None
        self.response_owner: OrderedDict[str, int] = OrderedDict()
        self.base_model: str | None = None  # the served model's name, as the workers' /health gives it (routing_key)
        self.moves: set[Move] = set()  # the requests whose prompts move now
        # what every worker must have been sent, in order (a restarted worker gets it again before any request):
        # the last weight update, then each adapter loaded and not unloaded since; (path, body, headers) by
        # "weights" or ("lora", name)
        self.broadcast_state: OrderedDict[Any, tuple[str, bytes, dict]] = OrderedDict()
        self.registry = CollectorRegistry()
        self.requests = Counter("hyla_router_requests", "Requests forwarded, by worker and why it was chosen.",
                                ["worker", "reason"], registry=self.registry)
        self.retries = Counter("hyla_router_retries", "Requests sent to another worker after one failed them (no "
                               "connection, or a 503).", registry=self.registry)
        self.busy_retries = Counter("hyla_router_busy_retries", "Requests sent to another worker after one answered "
                                    "429 (its waiting queue full).", registry=self.registry)
        self.in_flight = Gauge("hyla_router_in_flight", "Requests in flight, by worker.", ["worker"],
                               registry=self.registry)
        self.healthy = Gauge("hyla_router_worker_healthy", "1 while the worker is healthy.", ["worker"],
                             registry=self.registry)
        self.prefills = Counter("hyla_router_prefills", "Routed requests that may move (prefill workers "
                                "given), by outcome: exported (a prefill worker's prefix came back), not_cached (nothing to move), refused (the "
                                "prefill worker's 4xx, the client's answer), failed (its 5xx), aborted (an "
                                "/abort_request stopped it), "
                                "no_prefill_worker (none healthy, or every one failed); local: not sent, the decode "
                                "worker lacking at most local_prefill_tokens of the prompt.", ["outcome"],
                                registry=self.registry)
        self.imports = Counter("hyla_router_prefix_imports", "Prefixes posted to a decode worker, by outcome: "
                               "imported, short (it took less: no room, or it no longer held the KV the "
                               "prefix left out), refused.", ["outcome"], registry=self.registry)
        self.prefix_bytes = Counter("hyla_router_prefix_bytes", "Bytes of prefixes moved from prefill to decode "
                                    "workers.", registry=self.registry)

    # ------------------------------------------------------------------------------------------
    # lifecycle and health
    # ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        # idle connections dropped before a worker's uvicorn drops them (5 s): reusing one it has just
        # closed fails the request
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        await self.check_health()

    async def stop(self) -> None:
        for w in self.workers + self.prefill_workers:
            if w.replay is not None:
                w.replay.cancel()
        if self.client is not None:
            await self.client.aclose()

    async def check_health(self) -> None:
        """Ask every worker's ``/health`` (at once): 200 within the connect timeout is healthy. A worker whose
        answer names another ``cache_id`` than before emptied its prefix cache (a flush, a weight update, a
        restart): its table is cleared, so that the prompts sent there before no longer draw requests to it. One
        whose ``instance_id`` is new restarted: it serves its own start-up's weights and adapters, so it stays
        unhealthy while the weight update and the adapters broadcast before are sent to it again (``_replay``)."""
        tables = {id(w): table for w, table in self.all_workers()}

        async def one(w: Worker) -> None:
            answer: Any = None
            try:
                r = await self.client.get(w.url + "/health", timeout=self.timeout.connect)
                ok = r.status_code == 200
                if ok:
                    with contextlib.suppress(ValueError):
                        answer = r.json()
            except httpx.HTTPError:
                ok = False
            w.reachable = ok
            answer = answer if isinstance(answer, dict) else {}
            if isinstance(answer.get("model"), str):
                self.base_model = answer["model"]
            cache_id, instance_id = answer.get("cache_id"), answer.get("instance_id")
            if isinstance(cache_id, str):
                if w.cache_id is not None and cache_id != w.cache_id:
                    logger.info("worker %s emptied its prefix cache (or restarted): its routing table is cleared",
                                w.url)
                    tables[id(w)].clear()
                w.cache_id = cache_id
            if isinstance(instance_id, str):
                if w.instance_id is not None and instance_id != w.instance_id and self.broadcast_state:
                    logger.warning("worker %s restarted: it gets the weight update and LoRA adapters sent to every "
                                   "worker again before any request", w.url)
                    w.owed = list(self.broadcast_state.values())
                w.instance_id = instance_id
            if ok and w.owed:  # (healthy once what it lacks is sent)
                if w.replay is None:
                    w.replay = asyncio.create_task(self._replay(w))
                ok = False
            if ok != w.healthy:
                logger.warning("worker %s is %s", w.url, "healthy again" if ok else "unhealthy")
            self._set_health(w, ok)
        await asyncio.gather(*(one(w) for w in self.workers + self.prefill_workers))

    async def _replay(self, w: Worker) -> None:
        """Send worker ``w`` the broadcasts it lacks (``owed``, in order); healthy once it took all of them, else
        unhealthy still, tried again (from the first it has not taken) at the next health check."""
        try:
            while w.owed:
                item = w.owed[0]
                path, body, headers = item
                if path == "/v1/load_lora_adapter":  # (in place: a worker started with it loaded takes it too)
                    with contextlib.suppress(ValueError, TypeError):
                        body = json.dumps({**json.loads(body), "load_inplace": True}).encode()
                try:
                    answer = await self.client.post(w.url + path, content=body, headers=headers,
                                                    timeout=httpx.Timeout(None, connect=self.timeout.connect))
                except httpx.HTTPError as exc:
                    logger.warning("worker %s failed %s again (%r): unhealthy still", w.url, path, exc)
                    return
                if answer.status_code != 200:
                    logger.warning("worker %s refused %s again (%d: %s): unhealthy still", w.url, path,
                                   answer.status_code, answer.text[:300])
                    return
                if w.owed and w.owed[0] is item:  # (not replaced meanwhile: a restart, a later broadcast)
                    w.owed.pop(0)
            w.owed = None
            logger.warning("worker %s took the weight update and adapters again: healthy", w.url)
            self._set_health(w, True)
        finally:
            w.replay = None

    def _settle(self, w: Worker, path: str, raw: bytes) -> None:
        """Worker ``w`` took the broadcast ``raw`` to ``path``: what it owed that this replaces (an older weight
        update; a load or unload of the same adapter) is owed no more; owing nothing, it is healthy again."""
        if not w.owed:
            return
        key = _broadcast_key(path, raw)
        w.owed = [item for item in w.owed if _broadcast_key(item[0], item[1]) != key] or None
        if w.owed is None and w.reachable:
            logger.warning("worker %s took what it owed: healthy", w.url)
            self._set_health(w, True)

    def _remember_broadcast(self, path: str, raw: bytes, headers: dict) -> None:
        """A weight update or an adapter's load or unload workers took: what a restarted worker gets again (the
        last update first, then the adapters loaded and not unloaded since)."""
        key = _broadcast_key(path, raw)
        if key is None:
            return
        self.broadcast_state.pop(key, None)
        if path == "/v1/unload_lora_adapter":
            return
        self.broadcast_state[key] = (path, raw, headers)
        if key == "weights":
            self.broadcast_state.move_to_end("weights", last=False)  # (first: the adapters apply to new weights)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            with contextlib.suppress(Exception):  # (a check never ends the loop)
                await self.check_health()

    def _set_health(self, w: Worker, ok: bool) -> None:
        w.healthy = ok
        self.healthy.labels(w.url).set(1 if ok else 0)

    def _fail(self, w: Worker, why: str) -> None:
        if w.healthy:
            logger.warning("worker %s %s: unhealthy until its health check passes", w.url, why)
        self._set_health(w, False)

    # ------------------------------------------------------------------------------------------
    # forwarding
    # ------------------------------------------------------------------------------------------
    def _pick(self, path: str, key: str | list[int] | None, owner: int | None, tried: frozenset[int]) -> tuple[int, str]:
        """The worker for the next try of a request (``ValueError``: none left; ``OwnerUnavailable``: the worker
        holding what it reads is unhealthy, or failed it: no other worker could answer it but 'not found')."""
        loads = [w.in_flight for w in self.workers]
        healthy = [w.healthy for w in self.workers]
        if owner is not None:
            if healthy[owner] and owner not in tried:
                return owner, "owner"
            raise OwnerUnavailable(owner)
        if path in ROUTED_PATHS:
            return self.router.choose(key, loads, healthy, exclude=tried)
        live = [i for i in range(len(self.workers)) if healthy[i] and i not in tried]
        if not live:
            raise ValueError("no healthy worker")
        return self.router.least_loaded(live, loads), "load"

    async def owner(self, request: Request, path: str, body: Any) -> int | None:
        """The worker holding the stored response or conversation this request reads (a turn's, or its
        ``input_tokens`` count's, ``conversation``, else its ``previous_response_id``, else the response of its
        first ``item_reference``, whose id names it: ``output_item_id``; or the one of a ``/v1/responses/{id}...``
        or ``/v1/conversations/{id}...`` path; a new conversation's, the response of its first ``item_reference``):
        the one the router saw make it, else the one that answers for it (asked in turn; then remembered). (Items
        added to a conversation go where it is: an ``item_reference`` there names a response of that worker.)"""
        if path in ("/v1/responses", "/v1/responses/input_tokens") and isinstance(body, dict):
            rid = _conversation_id(body.get("conversation"))
            if rid is None:
                rid = body.get("previous_response_id")
            if not isinstance(rid, str):
                rid = _referenced_response(body.get("input"))
            if rid is None:
                return None
        elif path == "/v1/conversations" and isinstance(body, dict):  # (a new one whose items refer to a response)
            rid = _referenced_response(body.get("items"))
            if rid is None:
                return None
        elif path.startswith(("/v1/responses/", "/v1/conversations/")):
            rid = path.split("/")[3]
        else:
            return None
        if rid in self.response_owner:
            return self.response_owner[rid]
        if not RESPONSE_ID_FORM.fullmatch(rid):
            return None  # (no response has such an id: any worker answers so)
        where = STORED_PATHS["conv_" if rid.startswith("conv_") else "resp_"]
        headers = self.forwarded_headers(request)
        for i, w in enumerate(self.workers):
            if not w.healthy:
                continue
            try:  # (a worker that stalls or fails here is not the owner: the next is asked)
                answer = await self.client.get(f"{w.url}{where}{rid}", headers=headers, timeout=OWNER_LOOKUP_SECONDS)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                self._remember(rid, i)
                return i
        return None

    def _remember(self, response_id: str, worker: int) -> None:
        self.response_owner[response_id] = worker
        self.response_owner.move_to_end(response_id)
        while len(self.response_owner) > MAX_REMEMBERED_RESPONSES:
            self.response_owner.popitem(last=False)

    async def forward(self, request: Request, path: str) -> Response:
        """Send ``request`` to a worker (another one where it fails before answering) and answer with
        the worker's answer, a stream as a stream."""
        raw = await self.read_body(request)
        if isinstance(raw, Response):
            return raw
        if len(raw) > PARSE_IN_THREAD_BYTES:  # (its JSON and key off the event loop)
            body, key = await asyncio.to_thread(_parse, raw, path, self.base_model)
        else:
            body, key = _parse(raw, path, self.base_model)
        owner = await self.owner(request, path, body)
        headers = self.forwarded_headers(request)
        prefix: bytes | None = None  # a prefill worker's, to import before the request
        ask = self.disaggregates(request, path, body, owner)  # whether the decode worker may send it to prefill
        pinned: int | None = None  # the decode worker the prefix was made for (it holds the KV left out)
        move: Move | None = None  # while the prompt moves (an abort meanwhile is kept there)
        aborted: str | None = None  # an abort came while it moved ("1", or its rids): the worker answers so
        tried: set[int] = set()
        try:
            while True:
                if pinned is not None and self.workers[pinned].healthy and pinned not in tried:
                    i, why, pinned = pinned, "prefilled", None
                else:
                    try:
                        i, why = self._pick(path, key, owner, frozenset(tried))
                    except OwnerUnavailable as exc:  # (a 503 the OpenAI client retries, after Retry-After)
                        retry = str(max(1, math.ceil(min(self.health_interval, 30.0))))
                        return error_response(
                            path, 503, f"the worker holding this response or conversation "
                            f"({self.workers[exc.owner].url}) is unavailable: retry once its health check passes",
                            headers={"Retry-After": retry})
                    except ValueError:
                        return error_response(path, 503, "no worker is available: every worker is unhealthy or "
                                                         "failed the request")
                w = self.workers[i]
                w.in_flight += 1
                self.in_flight.labels(w.url).inc()
                try:
                    if prefix is not None and not (move is not None and move.aborted.is_set()):
                        await self._import(w, prefix, headers)
                        if await request.is_disconnected():  # (it left during the move: nothing is to be computed)
                            self._done(w)
                            return Response(status_code=499)
                    if move is not None:  # (from here on an abort reaches the request on the worker)
                        self.moves.discard(move)
                        aborted = "1" if move.aborted.is_set() else \
                            json.dumps(sorted(move.aborted_rids)) if move.aborted_rids else None
                        move = None
                    sent = {**headers, LOCAL_PREFILL_HEADER: str(self.local_prefill_tokens)} if ask else headers
                    if aborted:  # (all of it, or the choices of these rids: ABORTED_HEADER)
                        sent = {**sent, ABORTED_HEADER: aborted}
                    upstream_request = self.client.build_request(request.method, w.url + path, content=raw,
                                                                 headers=sent, params=request.query_params.multi_items(),
                                                                 timeout=self.request_timeout)
                    upstream = await self._send(request, upstream_request)
                except httpx.TransportError as exc:  # no answer: refused, reset, closed before the headers
                    self._retry_elsewhere(w, i, tried, f"failed a request ({exc!r})")
                    continue
                except BaseException:
                    self._done(w)
                    raise
                if upstream is None:  # the client left before the answer's headers
                    self._done(w)
                    return Response(status_code=499)
                if ask and upstream.status_code == 409:
                    try:
                        data = await upstream.aread()
                    except (httpx.TransportError, httpx.DecodingError) as exc:
                        self._retry_elsewhere(w, i, tried, f"failed mid-answer ({exc!r})")
                        continue
                    except BaseException:
                        self._done(w)
                        raise
                    finally:
                        await upstream.aclose()
                    self._done(w)
                    if _error_code(data) != PREFILL_ELSEWHERE:  # (another 409: the client's answer)
                        w.routed += 1
                        return _headers(Response(data, status_code=409), upstream)
                    # it computed nothing: the prompt is long and new to it, a prefill worker computes it for it
                    ask, pinned = False, i
                    held = str(header_count(upstream.headers.get(CACHED_TOKENS_HEADER)) or 0)  # (its KV stays home)
                    rid = body.get("rid")
                    move = Move(frozenset([rid] if isinstance(rid, str) else
                                          [r for r in rid if isinstance(r, str)] if isinstance(rid, list) else []))
                    self.moves.add(move)
                    prefix = await self._unless_aborted(move, self.prefill(request, path, raw, key,
                                                                           {**headers, KV_FROM_HEADER: held}))
                    if prefix is None and move.aborted.is_set():
                        self.prefills.labels("aborted").inc()
                    if isinstance(prefix, Response):
                        return prefix
                    continue
                if ask and upstream.status_code < 400:
                    self.prefills.labels("local").inc()
                if upstream.status_code == 503 and owner is None and self._others_left(i, tried):
                    # the worker is shutting down or its engine is not running: another one may serve it
                    self._retry_elsewhere(w, i, tried, "answered 503")
                    await upstream.aclose()
                    continue
                if upstream.status_code == 429 and owner is None and self._others_left(i, tried):
                    # its queue is full, not the others' (perhaps): busy, not unhealthy
                    self._done(w)
                    tried.add(i)
                    self.busy_retries.inc()
                    await upstream.aclose()
                    continue
                w.routed += 1
                self.requests.labels(w.url, why).inc()
                if path in ROUTED_PATHS and upstream.status_code < 400:  # (a worker that refused it computed nothing)
                    self.router.record(i, key)
                try:
                    return self._answer(upstream, w, i, remember=path in ("/v1/responses", "/v1/conversations")
                                        and request.method == "POST", head=request.method == "HEAD",
                                        api={"/v1/responses": "responses", "/v1/messages": "messages"}.get(path, "chat"))
                except BaseException:
                    self._done(w)
                    await upstream.aclose()
                    raise
        finally:  # (a move left behind by a return or a failure)
            if move is not None:
                self.moves.discard(move)

    # ------------------------------------------------------------------------------------------
    # prefill/decode disaggregation
    # ------------------------------------------------------------------------------------------
    def disaggregates(self, request: Request, path: str, body: Any, owner: int | None) -> bool:
        """Whether a request goes to a prefill worker first: there are some, and it is a routed POST of
        one prompt that reads no stored response (only its owner could render that)."""
        return (bool(self.prefill_workers) and request.method == "POST" and path in ROUTED_PATHS and owner is None
                and isinstance(body, dict) and not is_batch(path, body))

    async def note_abort(self, raw: bytes) -> None:
        """An ``/abort_request`` body (``_abort_target``): the moves it aborts are marked so. Read only while a
        prompt moves, and a large body off the event loop (as ``forward``'s)."""
        if not self.moves:
            return
        target = await asyncio.to_thread(_abort_target, raw) if len(raw) > PARSE_IN_THREAD_BYTES \
            else _abort_target(raw)
        if target is None:
            return
        rid, everyone = target
        for move in list(self.moves):
            if everyone:
                move.aborted.set()
            elif rid in move.rids:
                move.aborted_rids.add(rid)
                if move.aborted_rids >= move.rids:
                    move.aborted.set()

    @staticmethod
    async def _unless_aborted(move: Move, work: Awaitable[Any]) -> Any:
        """``work``'s result; None where ``move`` is aborted first (``work`` is cancelled: a prefill's
        connection closes, which aborts it on its worker)."""
        task = asyncio.ensure_future(work)
        aborted = asyncio.ensure_future(move.aborted.wait())
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return None if task.cancelled() else task.result()

    async def prefill(self, request: Request, path: str, raw: bytes, key: str | list[int] | None,
                      headers: dict[str, str]) -> bytes | Response | None:
        """Have a prefill worker compute the request's prompt and answer its cached prefix (the module
        docstring): its bytes; None where the decode worker is to compute the prompt itself (the prefill
        failed, or left nothing to move); or the client's answer (the prefill worker's 4xx, or a 499 when
        the client left)."""
        headers = {**headers, PREFILL_ONLY_HEADER: "1"}
        tried: set[int] = set()
        while True:
            loads = [w.in_flight for w in self.prefill_workers]
            healthy = [w.healthy for w in self.prefill_workers]
            try:
                i, _ = self.prefill_router.choose(key, loads, healthy, exclude=frozenset(tried))
            except ValueError:
                self.prefills.labels("no_prefill_worker").inc()
                return None
            w = self.prefill_workers[i]
            tried.add(i)
            w.in_flight += 1
            self.in_flight.labels(w.url).inc()
            try:
                upstream = await self._send(request, self.client.build_request(
                    "POST", w.url + path, content=raw, headers=headers, params=request.query_params.multi_items(),
                    timeout=self.request_timeout))
                if upstream is None:  # the client left
                    return Response(status_code=499)
                try:
                    data = await upstream.aread()
                finally:
                    await upstream.aclose()
            except (httpx.TransportError, httpx.DecodingError) as exc:  # (no answer, or one that cannot be read)
                self._fail(w, f"failed a prefill ({exc!r})")
                self.retries.inc()
                continue
            finally:
                self._done(w)
            w.routed += 1
            self.requests.labels(w.url, "prefill").inc()
            status = upstream.status_code
            if status in (429, 503):  # busy, or shutting down: another prefill worker may take it
                if status == 503:
                    self._fail(w, "answered 503")
                continue
            if status == 200 and header_count(upstream.headers.get(PREFIX_TOKENS_HEADER)) is not None:
                self.prefill_router.record(i, key)
                self.prefills.labels("exported").inc()
                self.prefix_bytes.inc(len(data))
                return data
            if status == 404 and _error_code(data) == PREFIX_NOT_CACHED:
                self.prefill_router.record(i, key)  # (it computed the prompt; nothing was left to move)
                self.prefills.labels("not_cached").inc()
                return None
            if 400 <= status < 500:
                self.prefills.labels("refused").inc()
                return _headers(Response(data, status_code=status), upstream)
            logger.warning("prefill worker %s answered %d: the decode worker computes the prompt", w.url, status)
            self.prefills.labels("failed").inc()
            return None

    async def _import(self, w: Worker, prefix: bytes, headers: dict[str, str]) -> None:
        """Put a prefill worker's ``prefix`` into worker ``w``'s cache (``/import_prefix``). A refusal is
        logged (``w`` then computes the prompt itself); a transport error propagates (``w`` failed), silence
        past ``read_timeout`` included, as on a forwarded request."""
        try:
            answer = await self.client.post(w.url + "/import_prefix", content=prefix, timeout=self.request_timeout,
                                            headers={**headers, "content-type": "application/octet-stream"})
        except httpx.DecodingError as exc:  # (an answer that cannot be read: taken or not, w computes what it lacks)
            self.imports.labels("short").inc()
            logger.warning("worker %s answered an import unreadably (%r)", w.url, exc)
            return
        if answer.status_code != 200:
            self.imports.labels("refused").inc()
            logger.warning("worker %s refused a prefix (%d: %s): it computes the prompt itself", w.url,
                           answer.status_code, answer.text[:300])
            return
        try:  # (short: the worker lacked room, or evicted the KV the prefix does not carry)
            took = answer.json()
            short = took["cached_tokens"] < took["prefix_tokens"]
        except (ValueError, KeyError, TypeError):
            short = True  # (not import_prefix's answer: count it as not taken; the worker computes the prompt)
        self.imports.labels("short" if short else "imported").inc()

    def _others_left(self, index: int, tried: set[int]) -> bool:
        """Whether a healthy worker other than ``index`` has not been tried for this request yet."""
        return any(w.healthy and j != index and j not in tried for j, w in enumerate(self.workers))

    def _retry_elsewhere(self, w: Worker, index: int, tried: set[int], why: str) -> None:
        """Worker ``index`` failed this request before answering it: no longer in flight there, the
        worker unhealthy, the request's next try elsewhere."""
        self._done(w)
        self._fail(w, why)
        tried.add(index)
        self.retries.inc()

    async def _send(self, request: Request, upstream_request: httpx.Request) -> httpx.Response | None:
        """The worker's answer (its headers; the body streams), or None if the client leaves first: a
        request answered whole (not streamed) sends its headers only once the worker has finished, and
        a worker aborts a request when its connection closes."""
        sending = asyncio.ensure_future(self.client.send(upstream_request, stream=True))
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=0.5)
                if done:
                    return sending.result()
                if await request.is_disconnected():
                    break
        except asyncio.CancelledError:  # (this request is stopped: the worker's request too)
            sending.cancel()
            if sending.done() and not sending.cancelled() and sending.exception() is None:
                await sending.result().aclose()
            raise
        sending.cancel()
        with contextlib.suppress(BaseException):
            late = await sending  # (it may have come while the disconnect was being checked: closed, not leaked)
            await late.aclose()
        return None

    async def read_body(self, request: Request) -> bytes | Response:
        """The request's body, or a 413 past ``max_request_bytes`` (read no further), or a 499 where the client
        leaves before it is whole (nothing reaches a worker; no error logged for a client's leaving)."""
        declared = request.headers.get("content-length")
        if (header_count(declared) or 0) > self.max_request_bytes:
            return self._too_large(request.url.path)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_request_bytes:
                    return self._too_large(request.url.path)
                chunks.append(chunk)
        except ClientDisconnect:
            return Response(status_code=499)
        return b"".join(chunks)

    def authorized(self, request: Request) -> bool:
        """Whether the request may pass: no key asked for, or its ``Authorization`` carries it (or, Anthropic's
        header, its ``x-api-key`` is it)."""
        return self.api_key is None or bearer_key_matches(request.headers.get("authorization"), self.api_key) or \
            secrets.compare_digest((request.headers.get("x-api-key") or "").encode(), self.api_key.encode())

    @staticmethod
    def unauthorized(path: str) -> Response:
        return error_response(path, 401, API_KEY_MESSAGE, type="authentication_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    def _too_large(self, path: str) -> Response:
        return error_response(path, 413, f"the request body is larger than {self.max_request_bytes} bytes",
                              type="invalid_request_error", code="request_too_large")

    @staticmethod
    def forwarded_headers(request: Request) -> dict[str, str | bytes]:
        """The client's headers a worker needs (their bytes as they came: a value outside ASCII passes through),
        and no compression: the answer's bytes pass through as they come."""
        headers: dict[str, str | bytes] = {}
        for k, v in request.headers.raw:
            name = k.decode("latin-1").lower()
            if name in FORWARDED_REQUEST_HEADERS:
                headers[name] = v
        headers["accept-encoding"] = "identity"
        return headers

    def _done(self, w: Worker) -> None:
        w.in_flight -= 1
        self.in_flight.labels(w.url).dec()

    def _answer(self, upstream: httpx.Response, w: Worker, index: int, remember: bool, head: bool = False,
                api: str = "chat") -> Response:
        """The worker's answer passed on chunk by chunk; the request stops counting as in flight, and
        the worker's connection closes, when the last chunk is sent or the client has gone (even
        before the first chunk: ``_Relay``). A worker that fails mid-answer is marked unhealthy, and a
        stream ends as the worker's own failed streams do, without the event it was cut in (``_EventCut``):
        an error event, then ``[DONE]``; ``api`` ``responses`` (a ``POST /v1/responses``), OpenAI's ``error`` and
        ``response.failed`` events; ``messages`` (Anthropic's), its ``error`` event. ``remember``: the id of what the answer made (a response, a
        conversation) is read from its first bytes, and the worker remembered as its owner."""
        closed = False
        events = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self._done(w)
                await upstream.aclose()

        async def chunks() -> AsyncIterator[bytes]:
            seen = b""
            cut = _EventCut() if events else None
            try:
                async for chunk in upstream.aiter_raw():
                    if remember and len(seen) < 4096:  # a response's (conversation's) id is in its first bytes
                        seen += chunk
                        m = RESPONSE_ID.search(seen)
                        if m:
                            self._remember(m.group(1).decode(), index)
                    chunk = cut.whole(chunk) if cut is not None else chunk
                    if chunk:
                        yield chunk
                if cut is not None and cut.pending:
                    yield cut.pending  # (a stream that ends without a blank line: as it came)
            except httpx.TransportError as exc:
                self._fail(w, f"failed mid-answer ({exc!r})")
                if cut is None:
                    raise  # (the client's connection is dropped: a whole answer cut short must not look complete)
                yield cut.failed(f"worker {w.url} failed mid-stream", api)  # (the cut event dropped)
            finally:
                await close()
        return _headers(_Relay(chunks(), close, status_code=upstream.status_code), upstream, head)

    async def broadcast(self, request: Request, path: str) -> Response:
        """Send ``request`` to every healthy worker; answer with the first failure's answer, else the
        first worker's. A weight update and a LoRA adapter's load need every worker healthy (one that came
        back later would serve the old weights, or lack the adapter)."""
        raw = await self.read_body(request)
        if isinstance(raw, Response):
            return raw
        if path == "/abort_request":  # (a request whose prompt moves is on no worker that knows it)
            await self.note_abort(raw)
        everyone = self.all_workers()
        # (a worker unhealthy only because it owes an earlier one takes these too: a later update or an unload
        # may be what replaces what it owes)
        live = [(w, table) for w, table in everyone
                if w.healthy or (path in ALL_WORKERS_PATHS and w.owed and w.reachable)]
        if not live:
            return error_response(path, 503, "no worker is available: every worker is unhealthy")
        if path in ALL_WORKERS_PATHS and len(live) < len(everyone):
            down = [w.url for w, _ in everyone if all(w is not taking for taking, _ in live)]
            what = {"/update_weights_from_disk": ("the weights were not updated", "serve the old weights"),
                    "/v1/load_lora_adapter": ("the LoRA adapter was not loaded", "lack it"),
                    "/v1/unload_lora_adapter": ("the LoRA adapter was not unloaded", "still serve it")}[path]
            return error_response(path, 503, f"{what[0]}: workers {down} are unhealthy, and would {what[1]} once back")
        answers = await self._send_to_each(request, path, raw, [w for w, _ in live])
        failed = None
        for (w, table), a in zip(live, answers):
            if isinstance(a, Exception):
                failed = failed or JSONResponse(error_body(f"worker {w.url} failed: {a!r}", type="bad_gateway"),
                                                status_code=502)
            elif path == "/flush_cache" and a.status_code == 200:
                table.clear()
        # (an unload answered 404 by a worker that no longer has the adapter: done there too)
        took = [w for (w, _), a in zip(live, answers) if not isinstance(a, Exception) and (
            a.status_code < 400 or (path == "/v1/unload_lora_adapter" and a.status_code == 404))]
        if path in ALL_WORKERS_PATHS and took:
            for w in took:
                self._settle(w, path, raw)
            if len(took) < len(live):  # (some took it: the fleet is mixed)
                return self._partly_applied(request, path, raw, live, answers, took)
            self._remember_broadcast(path, raw, self.forwarded_headers(request))
            done = [a for a in answers if a.status_code == 200]  # (an unload some had done already: their 404s)
            if done:
                return _headers(Response(done[0].content, status_code=200), done[0])
        if failed is not None:
            return failed
        bad = [a for a in answers if a.status_code >= 400]
        first = bad[0] if bad else answers[0]
        return _headers(Response(first.content, status_code=first.status_code), first)

    def _partly_applied(self, request: Request, path: str, raw: bytes, live: list[tuple[Worker, PrefixTable]],
                        answers: list, took: list[Worker]) -> Response:
        """A weight update or an adapter's load or unload some workers took and others failed (a checkpoint not on
        every machine yet): a 502 naming both. The update or load is what every worker must have now: the others
        owe it (``Worker.owed``), unhealthy until they take it (sent again at each health check), so that no
        request runs on the old weights, or lacks the adapter, beside those that do. An unload is not sent again
        (the others still serve the adapter: the answer says so)."""
        headers = self.forwarded_headers(request)
        missed = [(w, a) for (w, _), a in zip(live, answers) if all(w is not t for t in took)]
        self._remember_broadcast(path, raw, headers)  # (an unload: no worker restarted later gets it again)
        if path != "/v1/unload_lora_adapter":
            for w, _ in missed:
                w.owed = (w.owed or []) + [(path, raw, headers)]
                self._set_health(w, False)
        first = missed[0][1]
        reason = repr(first) if isinstance(first, Exception) else f"{first.status_code}: {first.text[:300]}"
        what = {"/update_weights_from_disk": ("the weights were updated", "get no requests until they take the "
                                              "update (sent again at each health check)"),
                "/v1/load_lora_adapter": ("the LoRA adapter was loaded", "get no requests until they load it (sent "
                                          "again at each health check)"),
                "/v1/unload_lora_adapter": ("the LoRA adapter was unloaded", "still serve it")}[path]
        message = (f"{what[0]} on workers {[w.url for w in took]} but not on {[w.url for w, _ in missed]} (the first "
                   f"failure: {reason}); those {what[1]}")
        logger.warning("%s", message)
        body = {**error_body(message, type="bad_gateway", code="partly_applied"), "success": False, "message": message}
        return JSONResponse(body, status_code=502)

    async def export_prefix(self, request: Request) -> Response:
        """``/export_prefix`` asked of every healthy worker (the router does not know which holds the
        prefix): the longest one's answer, else the first worker's (a 404, or its error)."""
        raw = await self.read_body(request)
        if isinstance(raw, Response):
            return raw
        live = [w for w, _ in self.all_workers() if w.healthy]
        if not live:
            return error_response("/export_prefix", 503, "no worker is available: every worker is unhealthy")
        answers = [a for a in await self._send_to_each(request, "/export_prefix", raw, live)
                   if not isinstance(a, Exception)]
        if not answers:
            return error_response("/export_prefix", 502, "every worker failed the export", type="bad_gateway")
        found = [(n, a) for a in answers if a.status_code == 200
                 and (n := header_count(a.headers.get(PREFIX_TOKENS_HEADER))) is not None]
        best = max(found, key=lambda na: na[0])[1] if found else answers[0]
        return _headers(Response(best.content, status_code=best.status_code), best)

    async def _send_to_each(self, request: Request, path: str, raw: bytes,
                            workers: list[Worker]) -> list[httpx.Response | Exception]:
        """``request`` (its method, query, ``raw`` body and headers a worker needs) sent to ``path`` of each
        of ``workers`` at once: each one's answer, or the error of one that failed (now unhealthy), one silent
        past ``BROADCAST_SECONDS`` of its path included."""
        headers = self.forwarded_headers(request)
        timeout = httpx.Timeout(BROADCAST_SECONDS.get(path), connect=self.timeout.connect)

        async def one(w: Worker) -> httpx.Response | Exception:
            try:
                return await self.client.request(request.method, w.url + path, content=raw, headers=headers,
                                                  params=request.query_params.multi_items(), timeout=timeout)
            except httpx.HTTPError as exc:
                self._fail(w, f"failed {request.method} {path} ({exc!r})")
                return exc
        return list(await asyncio.gather(*(one(w) for w in workers)))

    def all_workers(self) -> list[tuple[Worker, PrefixTable]]:
        """Every worker, the decode (or only) workers then the prefill workers, with its policy table."""
        prefill_tables = self.prefill_router.tables if self.prefill_router is not None else []
        return list(zip(self.workers, self.router.tables)) + list(zip(self.prefill_workers, prefill_tables))

    def workers_info(self, prefill: bool = False) -> list[dict[str, Any]]:
        """``/workers``' entries: the decode (or only) workers, or with ``prefill`` the prefill workers (``owed``: the
        paths of the broadcasts a worker has yet to take, where it has any)."""
        workers = self.all_workers()
        chosen = workers[len(self.workers):] if prefill else workers[:len(self.workers)]
        return [{"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "routed": w.routed,
                 "table_blocks": len(table), **({"owed": [path for path, _, _ in w.owed]} if w.owed else {})}
                for w, table in chosen]


class _Relay(StreamingResponse):
    """A ``StreamingResponse`` that runs ``close`` however it ends: sent whole, the client gone, or
    cancelled before its first chunk (when its generator never started, the generator's own
    ``finally`` would not run)."""

    def __init__(self, content: AsyncIterator[bytes], close, **kw: Any) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


SSE_EVENT_END = re.compile(rb"\r?\n\r?\n")  # the blank line that ends a server-sent event
SEQUENCE_NUMBER_END = re.compile(rb'"sequence_number":\s*(\d+)\}\s*$')  # a Responses event's last field
MAX_HELD_EVENT_BYTES = 1 << 20  # a stream holding back more than this without an event's end passes it on


class _EventCut:
    """A server-sent-event stream relayed by whole events: ``whole`` passes on a chunk's bytes up to the last
    event's end and holds the rest (``pending``), so that a worker failing mid-event leaves the client no
    half event (an SDK would fail parsing its JSON, not report the worker's failure); ``failed`` is the
    stream's end after such a failure. It also notes what a Responses stream's failed end needs: its
    ``response.created`` event and its last ``sequence_number``."""

    def __init__(self) -> None:
        self.pending = b""
        self.created: bytes | None = None  # the first event, where it is response.created (and not huge)
        self.sequence_number: int | None = None
        self._first = True

    def whole(self, chunk: bytes) -> bytes:
        """What of ``pending + chunk`` to pass on now: up to the last event's end (all of it past
        ``MAX_HELD_EVENT_BYTES``)."""
        held = self.pending + chunk
        end = None
        for end in SSE_EVENT_END.finditer(held, max(0, len(self.pending) - 3)):
            pass
        if end is None and len(held) <= MAX_HELD_EVENT_BYTES:
            self.pending = held
            return b""
        cut = end.end() if end is not None else len(held)
        out, self.pending = held[:cut], held[cut:]
        if self._first and end is not None:
            self._first = False
            first = out[:SSE_EVENT_END.search(out).end()]
            if first.startswith(b"event: response.created") and len(first) <= 1 << 16:
                self.created = first
        m = SEQUENCE_NUMBER_END.search(out[-64:])
        if m:
            self.sequence_number = int(m.group(1))
        return out

    def failed(self, message: str, api: str = "chat") -> bytes:
        """The stream's end after the worker failed (what it held back of a cut event dropped), as the ``api``'s
        own failed streams end: chat's error event and ``[DONE]``; an Anthropic stream (``messages``) its
        ``error`` event (an SDK raises it); a Responses stream (``responses``) OpenAI's ``error`` event (``code``
        ``worker_failed``) and, once the response was created, ``response.failed`` with it (``status``
        failed, ``error``)."""
        self.pending = b""
        if api == "messages":
            error = {"type": "error", "error": {"type": "api_error", "message": message}}
            return f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        if api != "responses":
            error = error_body(message, type="bad_gateway", code="worker_failed")
            return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        seq = (self.sequence_number + 1) if self.sequence_number is not None else 0
        out = typed_event("error", code="worker_failed", message=message, param=None, sequence_number=seq).encode()
        response = self._created_response()
        if response is not None:
            response.update(status="failed", error={"code": "server_error", "message": message})
            out += typed_event("response.failed", response=response, sequence_number=seq + 1).encode()
        return out

    def _created_response(self) -> dict | None:
        """The response of the stream's ``response.created`` event, or None."""
        if self.created is None:
            return None
        for line in self.created.splitlines():
            if line.startswith(b"data:"):
                try:
                    response = json.loads(line[5:]).get("response")
                except (ValueError, AttributeError):
                    return None
                return response if isinstance(response, dict) else None
        return None


def create_router_app(worker_urls: Sequence[str], policy: str = DEFAULT_POLICY, *, cache_threshold: float = 0.3,
                      balance_abs: int = 64, balance_rel: float = 1.5, max_blocks: int = 1 << 18,
                      health_interval: float = 5.0, connect_timeout: float = 5.0,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, api_key: str | None = None,
                      prefill_urls: Sequence[str] = (), local_prefill_tokens: int = DEFAULT_LOCAL_PREFILL_TOKENS,
                      read_timeout: float | None = None, **cors: Any) -> FastAPI:
    """The router's FastAPI app over ``worker_urls`` (with ``prefill_urls``: the decode workers, and
    those the prefill workers; the module docstring); ``app.state.router`` is its ``RouterApp``. ``cors``:
    ``hyla.server.cors.add_cors``' options, as a worker's (default: any origin), answered by the router itself.
    ``read_timeout``: seconds a worker may send nothing on a forwarded request (before its answer, or between
    two chunks of a stream) before it has failed it (None, the default: no limit)."""
    def policy_over(urls: Sequence[str]) -> Router:
        return Router(len(urls), policy, cache_threshold, balance_abs, balance_rel, max_blocks)

    state = RouterApp(worker_urls, policy_over(check_worker_urls(worker_urls)), health_interval, connect_timeout,
                      max_request_bytes, api_key, prefill_urls, policy_over(prefill_urls) if prefill_urls else None,
                      local_prefill_tokens, read_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        checks = asyncio.create_task(state.health_loop())
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await state.stop()

    app = FastAPI(title="hyla router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    add_cors(app, **cors)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        live = sum(w.healthy for w in state.workers)
        body = {"status": "ok" if live else "unavailable", "healthy_workers": live, "workers": len(state.workers)}
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/workers")
    async def workers(request: Request) -> Response:
        if not state.authorized(request):
            return state.unauthorized(request.url.path)
        info = {"policy": state.router.policy, "workers": state.workers_info()}
        if state.prefill_workers:
            info["prefill_workers"] = state.workers_info(prefill=True)
        return JSONResponse(info)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"])
    async def proxy(request: Request, path: str) -> Response:
        path = "/" + path
        if not state.authorized(request):
            return state.unauthorized(request.url.path)
        if not _safe_path(path):
            return error_response(path, 404, f"no such path: {path!r}", type="not_found_error", code="not_found")
        if path == "/export_prefix" and request.method == "POST":
            return await state.export_prefix(request)
        if path in BROADCAST_PATHS and request.method == "POST":
            return await state.broadcast(request, path)
        return await state.forward(request, path)

    return app
