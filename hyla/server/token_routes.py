"""vLLM's tokenizer endpoints (SGLang serves the same shapes): ``POST /tokenize``, ``POST /detokenize``.

Agent frameworks count a conversation's tokens against the context before they send it, so
``/tokenize`` answers exactly the ids the engine would be fed: a ``prompt`` as /v1/completions
tokenizes it, ``messages`` as /v1/chat/completions renders and tokenizes them (the same message
conversion, template variables, tools and special-token rules: only the template's markup yields
special tokens). Its ``count`` is that request's ``usage.prompt_tokens``. Like the generating
endpoints, it checks the prompt cap first and tokenizes on a worker thread, so a long prompt does
not stall the event loop.

``/detokenize`` turns ids of the model's vocabulary back into text, special tokens kept (as vLLM
decodes them): the round trip of a chat gives its rendered prompt.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from hyla.engine.engine import Engine
from hyla.server.errors import APIError
from hyla.server.openai_routes import chat_images, render_chat
from hyla.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from hyla.tokenizer import Tokenizer

if TYPE_CHECKING:
    from hyla.server.app import Server


class TokenRoutes:
    """The tokenizer endpoints of one ``Server``."""

    def __init__(self, server: Server):
        self.server = server

    def router(self) -> APIRouter:
        router = APIRouter()
        router.post("/tokenize")(self.tokenize)
        router.post("/detokenize")(self.detokenize)
        return router

    async def tokenize(self, body: TokenizeRequest) -> Response:
        if body.model is not None:
            self.server.check_model(body.model)
        problem = body.form_error()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        engine = self.server.admit()
        tokenizer = _tokenizer(engine)
        if body.messages is not None:  # as /v1/chat/completions (no message boundaries: the cache's, a render each)
            ids = (await render_chat(self.server, tokenizer, body.messages, body.template_tools(),
                                     body.chat_template_kwargs, add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     documents=body.documents)).ids
            images = await chat_images(self.server, engine, body.messages, body.mm_processor_kwargs)
            if images:  # each placeholder repeated to its image's tokens: the prompt as the engine feeds it
                try:
                    ids = await asyncio.to_thread(engine.prompt_ids, ids, images)
                except ValueError as exc:
                    raise APIError(400, str(exc), param="messages") from None
        else:  # as /v1/completions tokenizes a text prompt
            (ids,) = await self.server.encode_texts(tokenizer, [body.prompt or ""], "prompt",
                                                    add_special_tokens=body.add_special_tokens is not False)
        strs = await asyncio.to_thread(lambda: [tokenizer.id_to_token(i) or "" for i in ids]) \
            if body.return_token_strs else None  # (a long prompt's strings: off the event loop too)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.context_length, tokens=ids,
                                             token_strs=strs).model_dump())

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        if body.model is not None:
            self.server.check_model(body.model)
        engine = self.server.admit()
        tokenizer = _tokenizer(engine)
        text = await asyncio.to_thread(_decode, tokenizer, body.tokens, engine.model_config.vocab_size)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())


def _tokenizer(engine: Engine) -> Tokenizer:
    """The engine's tokenizer; a 400 for a model without one."""
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer (no tokenizer.json or tiktoken.model), so the server "
                            "cannot tokenize or detokenize: send and read token ids")
    return engine.tokenizer


def _decode(tokenizer: Tokenizer, ids: list[int], vocab_size: int) -> str:
    """The text of ``ids``, special tokens kept; an id outside the model's vocabulary ``[0,
    vocab_size)`` (what the engine accepts in a prompt) is a 400. Ids the model has but the tokenizer
    lacks (a padded embedding) decode to nothing."""
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        i, bad = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise APIError(400, f"tokens[{i}] = {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return tokenizer.decode(ids, skip_special_tokens=False)
