"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models[/{model}]``.

A request, top-down: check the model name (the served model's, or a loaded LoRA adapter's: the jobs'
``lora_name``, and the name the answer echoes); tokenize (chat: render the template, and keep each
message's end as a checkpoint for the prefix cache); build ``n`` jobs per prompt (choice ``j``
samples with ``seed + j``); start them as one ``Generation``; then either stream each engine
chunk as an OpenAI chunk (its own text and logprobs) or collect the choices into one response.
Fields and semantics: docs/server.md.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response
from tokenizers import decoders

from hyla.server.disaggregation import disaggregation_answer
from hyla.server.errors import APIError
from hyla.server.generation import SSE_DONE, Choice, Generation, Job, chunk_logprobs, json_answer, sse
from hyla.server.protocol import (
    ChatChoice, ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
    ChatCompletionResponse, ChatResponseMessage, FunctionCall, ToolCallOut, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, ModelCard, ModelList, PromptTokensDetails, TopLogprob, UsageInfo,
    is_fetched,
    cache_namespace, text_chars,
)
from hyla.server.tool_calls import ToolCall
from hyla.engine.engine import Engine
from hyla.engine.grammar import GRAMMAR_KINDS
from hyla.tokenizer import REPLACEMENT_CHAR, ChatEncoding, Tokenizer, TokenText
from hyla.tokenizer.detokenizer import PROMPT_CONTEXT_TOKENS

if TYPE_CHECKING:
    from hyla.server.app import Server
    from hyla.model.image_processing import ProcessedImage
    from hyla.server.tool_call_stream import ToolCallDelta

CHAT_CHECKPOINTS = 8
"""Message ends per chat request where the engine caches the recurrent state: the first message's (a
shared system prompt) and the last seven's. Each costs a render of the conversation up to it."""
# what the template's own variables and helpers are named (and ``self``, ``Tokenizer.encode_chat``'s
# own first parameter): chat_template_kwargs may not replace them
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents", "max_boundaries",
                                         "continue_final_message", "raise_exception", "strftime_now", "namespace",
                                         "self"})

MAX_PENDING_IDS = 8
"""``TextOffsets`` over a window of ids: ids whose text still ends in U+FFFD after this many end in
invalid bytes (a character's bytes span 4 tokens at most), counted as the U+FFFD the text shows, so
that garbage output keeps the window short."""

Logprobs = list[tuple[float, int]]
TopLogprobs = list[list[tuple[float, int]]]


class OpenAIRoutes:
    """The OpenAI endpoints of one ``Server``."""

    def __init__(self, server: Server):
        self.server = server

    def router(self) -> APIRouter:
        router = APIRouter()
        router.get("/v1/models", response_model=ModelList)(self.list_models)
        router.get("/v1/models/{model:path}", response_model=ModelCard)(self.get_model)
        router.post("/v1/completions")(self.completions)
        router.post("/v1/chat/completions")(self.chat_completions)
        return router

    # --- /v1/models ----------------------------------------------------------------------------
    def _model_card(self, lora_name: str | None = None, adapters: dict[str, str] | None = None) -> ModelCard:
        """The served model's card, or a loaded LoRA adapter's (vLLM's: ``root`` its directory, ``parent``
        the served model's name, or its ``--lora-modules`` ``base_model_name``); ``adapters``: the loaded
        ones, as read once for a listing."""
        engine = self.server.admit()
        if lora_name is None:
            return ModelCard(id=self.server.model_name, root=str(engine.model_path),
                             max_model_len=engine.context_length)
        path = (adapters if adapters is not None else self.server.lora_adapters()).get(lora_name)
        if path is None:  # (unloaded meanwhile)
            self.server.check_model(lora_name)
        return ModelCard(id=lora_name, root=str(path), max_model_len=engine.context_length,
                         parent=self.server.lora_parents.get(lora_name, self.server.model_name))

    async def list_models(self) -> ModelList:
        adapters = self.server.lora_adapters()  # (one snapshot: an unload meanwhile cannot 404 the listing)
        return ModelList(data=[self._model_card(), *(self._model_card(name, adapters) for name in adapters)])

    async def get_model(self, model: str) -> ModelCard:
        return self._model_card(self.server.check_model(model))

    # --- /v1/completions -----------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        lora_name = self.server.check_model(body.model)
        engine = self.server.admit()
        top_k = body.logprobs or 0
        prompts = body.prompts()
        id_lists = await self._prompt_ids(engine, prompts)
        if body.truncate_prompt_tokens is not None:
            kept = [truncate_prompt(body, ids, engine.context_length, body.max_tokens) for ids in id_lists]
            # a cut prompt is echoed as what the engine was fed: its kept ids, decoded
            prompts = [k if len(k) < len(ids) else p for p, ids, k in zip(prompts, id_lists, kept)]
            id_lists = kept
        # echo + logprobs: the prompt's logprobs too (its first token has none)
        start = 0 if body.echo and body.logprobs is not None else -1
        jobs = []
        rids = job_rids(body.rid, request.headers.get(REQUEST_ID_HEADER), len(id_lists) * body.n)
        for p, ids in enumerate(id_lists):
            max_new = output_budget(engine, len(ids), body.max_tokens, "max_tokens", "prompt")
            _check_min_tokens(body.min_tokens, max_new, budget_limit(engine, len(ids), body.max_tokens, "max_tokens"))
            jobs += [Job(ids, body.sampling_params(max_new, top_k, j), return_logprob=body.logprobs is not None,
                         logprob_start_len=start, priority=body.priority, namespace=cache_namespace(body.cache_salt),
                         rid=rids[p * body.n + j], lora_name=lora_name)
                     for j in range(body.n)]
        answer = await disaggregation_answer(self.server, "completions", jobs, arrival, request)
        if answer is not None:
            return answer
        echoed = [_prompt_text(engine, p) for p in prompts] if body.echo else None
        gen = await self._start(body, "completions", jobs, arrival)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return gen.stream(self._completion_events(body, gen, rid, prompts, id_lists, echoed))
        collected = await gen.collect(request)

        def answer() -> dict[str, Any]:  # (on a worker thread: json_answer)
            choices = []
            for c in collected:
                p = c.index // body.n
                prefix = echoed[p] if echoed is not None else ""
                text = prefix + c.text
                logprobs = None
                if body.logprobs is not None:
                    offsets = TextOffsets(engine.tokenizer, id_lists[p], body.skip_special_tokens, start=len(prefix))
                    logprobs = completion_logprobs(engine.tokenizer, *choice_logprobs(c), offsets, end=len(text))
                    if echoed is not None:
                        logprobs = _prompt_logprobs(engine.tokenizer, c, prompts[p], prefix).extend(logprobs)
                choices.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.openai_finish_reason(),
                                                **_token_ids(body, id_lists[p], c.output_ids)))
            return CompletionResponse(id=rid, model=body.model, choices=choices,
                                      usage=usage(gen.choices, body.n)).model_dump()
        return await json_answer(answer)

    async def _completion_events(self, body: CompletionRequest, gen: Generation, rid: str,
                                 prompts: list[str | list[int]], id_lists: list[list[int]],
                                 echoed: list[str] | None) -> AsyncIterator[str]:
        created = int(time.time())
        tokenizer = gen.engine.tokenizer
        # text_offset continues across a choice's chunks (its TextOffsets, made at its first chunk); a
        # token goes out with the first chunk whose text reaches its offset (a stop string may still cut
        # the text held back: then the last chunk has it, its offset at the text's end), so the streamed
        # logprobs are the whole answer's
        offsets: dict[int, TextOffsets] = {}
        held: dict[int, CompletionLogprobs] = {}  # tokens that start beyond the text sent so far
        started = [False] * len(gen.choices)  # echo: the prompt goes before a choice's first chunk
        sent = [0] * len(gen.choices)  # characters of each choice's text sent so far
        async for choice, chunk in gen.events():
            text, logprobs = chunk["text"], None
            prompt_logprobs = None
            finish = choice.openai_finish_reason()
            p = choice.index // body.n
            first = not started[choice.index]
            if first:
                started[choice.index] = True
                prefix = echoed[p] if echoed is not None else ""
                text = prefix + text
                if body.logprobs is not None:
                    offsets[choice.index] = TextOffsets(tokenizer, id_lists[p], body.skip_special_tokens,
                                                        start=len(prefix))
                    held[choice.index] = CompletionLogprobs()
                    if echoed is not None:
                        prompt_logprobs = _prompt_logprobs(tokenizer, choice, prompts[p], prefix)
            sent[choice.index] += len(text)
            if body.logprobs is not None:
                new = completion_logprobs(tokenizer, *chunk_logprobs(chunk), offsets[choice.index])
                logprobs = _take_started(held[choice.index].extend(new), sent[choice.index], final=finish is not None)
                if prompt_logprobs is not None:
                    logprobs = prompt_logprobs.extend(logprobs)
            # (with return_token_ids every engine chunk goes out: its ids, even where it shows no text)
            if text or finish or (logprobs and logprobs.tokens) or body.return_token_ids:
                ids = _token_ids(body, id_lists[p] if first else None, chunk["output_ids"])
                out = CompletionResponse(id=rid, created=created, model=body.model, choices=[
                    CompletionChoice(index=choice.index, text=text, logprobs=logprobs, finish_reason=finish, **ids)],
                    usage=usage([choice], 1) if body.continuous_usage() else None)
                yield sse(out)
        if body.include_usage():
            yield sse(CompletionResponse(id=rid, created=created, model=body.model, choices=[],
                                         usage=usage(gen.choices, body.n)))
        yield SSE_DONE

    # --- /v1/chat/completions ------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        engine = admit_chat(self.server, body.model)
        lora_name = self.server.check_model(body.model)  # (admit_chat checked it: the adapter it names)
        encoding = await render_chat(self.server, engine.tokenizer, body.messages, body.template_tools(),
                                     body.chat_template_kwargs, add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     max_boundaries=CHAT_CHECKPOINTS, documents=body.documents)
        # a prefill (the final assistant message, continued): the answer is what the model writes after it
        prefill = final_text(body.messages) if body.continue_final_message else None
        if body.truncate_prompt_tokens is not None:
            if chat_image_urls(body.messages):
                raise APIError(400, "truncate_prompt_tokens cuts the prompt's tokens, and cannot cut its images' (it "
                                    "takes a chat without images)", param="truncate_prompt_tokens")
            encoding = truncate_chat(encoding, truncate_prompt(body, encoding.ids, engine.context_length,
                                                               body.max_new_tokens()))
        images = await chat_images(self.server, engine, body.messages, body.mm_processor_kwargs)
        max_new = output_budget(engine, len(encoding.ids) + image_tokens(images), body.max_new_tokens(),
                                body.max_new_tokens_field(), "messages")
        _check_min_tokens(body.min_tokens, max_new, budget_limit(engine, len(encoding.ids) + image_tokens(images),
                                                                 body.max_new_tokens(), body.max_new_tokens_field()))
        top_k = (body.top_logprobs or 0) if body.logprobs else 0
        grammar = {**forced_tool_grammar(self.server, body), **kept_markers(self.server, body)}
        jobs = [Job(encoding.ids, thinking_first(self.server, encoding.text, {**body.sampling_params(max_new, top_k, j),
                                                                             **grammar}, prefill=prefill),
                    return_logprob=body.logprobs,
                    checkpoints=list(encoding.boundaries), speculative_checkpoints=True, priority=body.priority,
                    namespace=cache_namespace(body.cache_salt), rid=rid, lora_name=lora_name,
                    image_data=images)
                for j, rid in enumerate(job_rids(body.rid, request.headers.get(REQUEST_ID_HEADER), body.n))]
        answer = await disaggregation_answer(self.server, "chat", jobs, arrival, request)
        if answer is not None:
            return answer
        gen = await self._start(body, "chat", jobs, arrival)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        in_thinking = opens_thinking(self.server, encoding.text, prefill)
        # the prompt as fed (its images' tokens too: what usage counts), for return_token_ids
        prompt_ids = engine.prompt_ids(encoding.ids, images) if images and body.return_token_ids else encoding.ids
        if body.stream:
            return gen.stream(self._chat_events(body, gen, rid, in_thinking, prompt_ids))
        collected = await gen.collect(request)

        def answer() -> dict[str, Any]:  # (on a worker thread: json_answer)
            choices = []
            for c in collected:
                thoughts, text, calls = split_answer(self.server, body, c.text, in_thinking)
                finish = c.openai_finish_reason()
                finish = "tool_calls" if calls and finish == "stop" else finish
                message = ChatResponseMessage(
                    content=(text or None) if calls else text, reasoning_content=thoughts,
                    tool_calls=[ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                                for t in calls] or None)
                choices.append(ChatChoice(
                    index=c.index, message=message, finish_reason=finish,
                    logprobs=chat_logprobs(engine.tokenizer, *choice_logprobs(c)) if body.logprobs else None,
                    token_ids=list(c.output_ids) if body.return_token_ids else None))
            return ChatCompletionResponse(id=rid, model=body.model, choices=choices,
                                          usage=usage(gen.choices, body.n),
                                          prompt_token_ids=prompt_ids if body.return_token_ids else None).model_dump()
        return await json_answer(answer)

    async def _chat_events(self, body: ChatCompletionRequest, gen: Generation, rid: str,
                           in_thinking: bool, prompt_ids: list[int]) -> AsyncIterator[str]:
        created = int(time.time())
        # each call's id and name as soon as they come, its arguments as they are written (as vLLM and SGLang)
        answers = {c.index: AnswerStream(self.server, body, in_thinking) for c in gen.choices}
        num_calls = {c.index: 0 for c in gen.choices}  # the calls a choice has begun

        def chunk_of(choice: ChatChunkChoice, **extra: Any) -> str:
            return sse(ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[choice],
                                           **extra))

        # each choice's first chunk: its role (and, as vLLM's, the prompt's ids and the usage so far)
        first: dict[str, Any] = {"prompt_token_ids": prompt_ids} if body.return_token_ids else {}
        if body.continuous_usage():
            first["usage"] = UsageInfo(prompt_tokens=len(prompt_ids), total_tokens=len(prompt_ids))
        for choice in gen.choices:
            yield chunk_of(ChatChunkChoice(index=choice.index, delta={"role": "assistant", "content": ""}), **first)
        async for choice, chunk in gen.events():
            logprobs = chat_logprobs(gen.engine.tokenizer, *chunk_logprobs(chunk)) if body.logprobs else None
            finish = choice.openai_finish_reason()
            delta: dict[str, Any] = {}
            thought, text, calls = answers[choice.index].feed(chunk["text"], final=finish is not None)
            if thought:
                delta["reasoning_content"] = thought
            if calls:
                delta["tool_calls"] = [d.openai() for d in calls]
                num_calls[choice.index] = max(num_calls[choice.index], calls[-1].index + 1)
            if text:
                delta["content"] = text
            if finish == "stop" and num_calls[choice.index]:
                finish = "tool_calls"
            # (with return_token_ids every engine chunk goes out: its ids, even where the parsers hold its text)
            if delta or finish or (logprobs and logprobs.content) or body.return_token_ids:
                token_ids = list(chunk["output_ids"]) if body.return_token_ids else None
                yield chunk_of(ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs,
                                               finish_reason=finish, token_ids=token_ids),
                               usage=usage([choice], 1) if body.continuous_usage() else None)
        if body.include_usage():
            yield sse(ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[],
                                          usage=usage(gen.choices, body.n)))
        yield SSE_DONE

    # --- shared ----------------------------------------------------------------------------------
    async def _start(self, body: CompletionRequest | ChatCompletionRequest, endpoint: str, jobs: list[Job],
                     arrival: float) -> Generation:
        """``Server.start_generation``; a grammar the engine cannot compile is a 400 naming its field
        (``response_format``, ``structured_outputs.<kind>``, ``guided_*``, or, where a forced tool call
        made the grammar, the function's ``tools.<i>.function.parameters``: ``grammar_field``)."""
        try:
            return await self.server.start_generation(endpoint, jobs, arrival)
        except APIError as exc:
            if exc.status == 400 and exc.param == "response_format":  # (the engine's grammar fields, renamed)
                exc.param = body.grammar_field() or exc.param
            raise

    async def _prompt_ids(self, engine: Engine, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids; text is tokenized on a worker thread, after the prompt cap."""
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return prompts  # type: ignore[return-value]
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        encoded = iter(await self.server.encode_texts(tokenizer, texts, "prompt"))
        return [next(encoded) if isinstance(p, str) else p for p in prompts]


async def render_chat(server: Server, tokenizer: Tokenizer, chat: list[ChatMessage], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any] | None, *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, max_boundaries: int = 0,
                      documents: list[dict[str, Any]] | None = None) -> ChatEncoding:
    """``chat`` rendered with the model's template and tokenized, as a chat completion feeds it to the
    engine (``/tokenize`` too): the messages converted for the template (the tool-call parser's
    form of earlier calls), ``template_kwargs`` checked against the reserved variables, the prompt
    cap, then ``Tokenizer.encode_chat`` on a worker thread (a long conversation does not stall the
    event loop); ``continue_final_message``: the prompt ends inside the final message (a prefill; the
    request checked its rules: ``prefill_error``). A template's ``ValueError`` (one that cannot leave
    the final message open among them) is a 400 naming ``messages`` or ``chat_template_kwargs``."""
    check_takes_images(server.admit(), chat)
    messages = server.tool_call_parser.for_template([m.for_template() for m in chat],
                                                    tokenizer.chat_template_for(tools))
    reserved = sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    # the tools are rendered into the prompt too (their JSON, keys and all)
    server.check_prompt_chars(text_chars(messages) + text_chars(template_kwargs) + text_chars(tools, keys=True)
                              + text_chars(documents, keys=True), "messages")
    extra = {"documents": documents} if documents is not None else {}  # (the template's variable: vLLM's field)
    try:
        return await asyncio.to_thread(tokenizer.encode_chat, messages, add_generation_prompt=add_generation_prompt,
                                       tools=tools, continue_final_message=continue_final_message,
                                       max_boundaries=max_boundaries, **extra, **(template_kwargs or {}))
    except ValueError as exc:
        param = "chat_template_kwargs" if str(exc).startswith("template_kwargs") else "messages"
        raise APIError(400, str(exc), param=param) from exc


def split_answer(server: Server, chat: ChatCompletionRequest, output: str,
                 in_thinking: bool) -> tuple[str | None, str, list[ToolCall]]:
    """``(reasoning or None, content, calls)`` of a whole chat answer (``answer_in_order``'s pieces: the
    content joined, the calls). What a chat completion makes of its output."""
    thoughts, pieces = answer_in_order(server, chat, output, in_thinking)
    return (thoughts, "".join(p for p in pieces if isinstance(p, str)),
            [p for p in pieces if isinstance(p, ToolCall)])


def answer_in_order(server: Server, chat: ChatCompletionRequest, output: str,
                    in_thinking: bool) -> tuple[str | None, list[str | ToolCall]]:
    """``(reasoning or None, pieces)`` of a whole chat answer: the reasoning parser's split (the answer
    starts inside a think block where ``in_thinking``: ``opens_thinking``), then, unless the chat's
    ``tool_choice`` is none, the content and the calls in it in their order (``ToolCallParser.in_order``:
    each run of content one string; the first call alone without ``parallel_tool_calls``, the content
    around a dropped one joined). What a chat completion, a Responses turn and an Anthropic message make
    of their output."""
    reasoning = server.reasoning_parser
    thoughts, text = reasoning.parse(output, in_thinking) if reasoning is not None else (None, output)
    if chat.tool_choice_mode() == "none":
        return thoughts, [text] if text else []
    pieces: list[str | ToolCall] = []
    for piece in server.tool_call_parser.in_order(text, chat.template_tools()):
        if isinstance(piece, ToolCall) and not chat.parallel_tool_calls and any(isinstance(p, ToolCall) for p in pieces):
            continue
        if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        else:
            pieces.append(piece)
    return thoughts, pieces


class AnswerStream:
    """:func:`split_answer` of an answer as it streams: each chunk's text in (``feed``), ``(reasoning,
    content, call deltas)`` out — the reasoning parser's stream, then, unless the chat's ``tool_choice`` is
    none, the tool-call parser's incremental stream (``ToolCallStream``), the first call's deltas alone
    without ``parallel_tool_calls``. Joined, the pieces are ``split_answer``'s of the whole answer (but
    for a call a stream began and cannot take back: ``tool_call_stream``). What chat completions,
    Responses turns and Anthropic messages stream."""

    def __init__(self, server: Server, chat: ChatCompletionRequest, in_thinking: bool):
        reasoning = server.reasoning_parser
        self.thinking = reasoning.stream(in_thinking) if reasoning is not None else None
        self.tools = server.tool_call_parser.stream(chat.template_tools(), incremental=True) \
            if chat.tool_choice_mode() != "none" else None
        self.parallel = chat.parallel_tool_calls

    def feed(self, text: str, final: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """The next chunk's ``(reasoning, content, call deltas)``."""
        thought, pieces = self.feed_in_order(text, final)
        return (thought, "".join(p for p in pieces if isinstance(p, str)),
                [p for p in pieces if not isinstance(p, str)])

    def feed_in_order(self, text: str, final: bool) -> tuple[str, list[str | ToolCallDelta]]:
        """The next chunk's reasoning, and its content and call deltas in the output's order
        (``ToolCallStream.feed_in_order``: a chunk may hold text after a call)."""
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text, final=final)
        if self.tools is None:
            return thought, [text] if text else []
        pieces = self.tools.feed_in_order(text, final=final)
        return thought, [p for p in pieces if isinstance(p, str) or self.parallel or p.index == 0]

    @property
    def seen_reasoning(self) -> bool:
        """Whether the answer has a reasoning part (it began in a think block, or opened one)."""
        return self.thinking is not None and self.thinking.seen_reasoning

    @property
    def calls(self) -> list[ToolCall]:
        """The answer's calls so far, whole (``ToolCallStream.calls``; the first alone without
        ``parallel_tool_calls``)."""
        calls = self.tools.calls if self.tools is not None else []
        return calls if self.parallel else calls[:1]


def final_text(chat: list[ChatMessage]) -> str:
    """The text of a chat's final message (its text parts a line each, as a template that reads content as a
    string sees them: ``ChatTemplate.render``): what a prefill (``continue_final_message``) has the model
    continue."""
    content = chat[-1].for_template().get("content")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if part.get("type") == "text")
    return content if isinstance(content, str) else ""


async def chat_images(server: Server, engine: Engine, chat: list[ChatMessage],
                      processor_kwargs: dict[str, Any] | None = None) -> list[ProcessedImage] | None:
    """The chat's images in order: http(s) URLs fetched where the server allows their host (``media.py``), then
    each decoded and preprocessed on a worker thread (``Engine.process_images``: ``Engine.generate``'s
    ``image_data``; ``processor_kwargs``: the request's ``mm_processor_kwargs``); None without any. A 400
    naming ``messages`` for one that cannot be fetched or read, more than ``--limit-mm-per-prompt``, or where
    the model takes none; naming ``mm_processor_kwargs`` for an override the engine does not take."""
    sources = await image_sources(server, engine, chat)
    if sources is None:
        from hyla.model.image_processing import check_processor_kwargs

        try:  # (checked all the same: a request that sends them means them)
            check_processor_kwargs(processor_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="mm_processor_kwargs") from None
        return None
    return await on_images(engine.process_images, sources, processor_kwargs)


async def chat_image_tokens(server: Server, engine: Engine, chat: list[ChatMessage],
                            processor_kwargs: dict[str, Any] | None = None) -> int:
    """The tokens the chat's images add to its rendered prompt (one placeholder each), as :func:`chat_images`
    and :func:`image_tokens` count them, read from each image's header (``Engine.count_image_tokens``: no
    pixel decoded): what a count of the prompt needs. 400s as ``chat_images``'."""
    sources = await image_sources(server, engine, chat)
    if sources is None:
        return 0
    return sum(n - 1 for n in await on_images(engine.count_image_tokens, sources, processor_kwargs))


async def image_sources(server: Server, engine: Engine, chat: list[ChatMessage]) -> list[Any] | None:
    """The chat's images as ``Engine.process_images`` takes them (http(s) URLs fetched, each once: their bytes),
    None without any; checked against the model and ``--limit-mm-per-prompt`` before anything is fetched (a
    conversation that truncation may cut too: the limit bounds what a request has the server fetch)."""
    urls = chat_image_urls(chat)
    if not urls:
        return None
    check_takes_images(engine, chat)  # (before fetching anything)
    try:
        engine.check_image_count(len(urls))
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    fetched = iter(await server.media.fetch_all([u for u in urls if is_fetched(u)], "messages"))
    return [next(fetched) if is_fetched(u) else u for u in urls]


async def on_images(method: Any, sources: list[Any], processor_kwargs: dict[str, Any] | None, **kw: Any) -> Any:
    """``method(sources, processor_kwargs, **kw)`` on a worker thread (``Engine.process_images``,
    ``count_image_tokens``), its ``ValueError`` a 400 naming ``mm_processor_kwargs`` or ``messages``."""
    try:
        return await asyncio.to_thread(method, sources, processor_kwargs, **kw)
    except ValueError as exc:
        param = "mm_processor_kwargs" if getattr(exc, "param", None) == "mm_processor_kwargs" else "messages"
        raise APIError(400, str(exc), param=param) from None


def chat_image_urls(chat: list[ChatMessage]) -> list[str]:
    """The chat's images (their URLs), in order."""
    return [url for m in chat for url in m.image_urls()]


def check_takes_images(engine: Engine, chat: list[ChatMessage]) -> None:
    """A 400 naming ``messages`` where the chat has images and the model takes none (before its template
    meets the image parts it does not know)."""
    if engine.image_processor is None and chat_image_urls(chat):
        raise APIError(400, f"this model ({engine.model_config.architecture}) takes no images: send text content "
                            "parts only", param="messages")


def image_tokens(images: list[ProcessedImage] | None) -> int:
    """The tokens images add to a rendered prompt, which holds one placeholder token for each."""
    return sum(image.num_tokens - 1 for image in images or ())


def opens_thinking(server: Server, prompt: str, prefill: str | None = None) -> bool:
    """Whether a chat answer starts inside a think block: the rendered ``prompt`` opens one
    (``ReasoningParser.prompt_opens_thinking``). Where the prompt ends with a ``prefill`` (the final
    assistant message, continued: its text), the prefill decides when it holds a marker: its last
    ``<think>`` is open (no ``</think>`` after it), e.g. ``<think>\nLet me``; without one, the prompt
    before the prefill does (a template that writes the think block's start before the message)."""
    reasoning = server.reasoning_parser
    if reasoning is None:
        return False
    if prefill is None:
        return reasoning.prompt_opens_thinking(prompt)
    opened, closed = prefill.rfind(reasoning.start), prefill.rfind(reasoning.end)
    if opened >= 0 or closed >= 0:
        return opened > closed
    at = prompt.rfind(prefill.strip()) if prefill.strip() else len(prompt)
    return reasoning.prompt_opens_thinking(prompt[:at] if at >= 0 else prompt)


def thinking_first(server: Server, prompt: str, params: dict[str, Any], prefill: str | None = None) -> dict[str, Any]:
    """A chat answer's engine sampling ``params``, whose grammar (a forced tool call, ``response_format``)
    constrains what the reasoning parser reads as content, not the reasoning before it (SGLang's and
    vLLM's reasoning-aware structured outputs): where the rendered ``prompt`` opens a think block, the
    grammar starts after its end (``grammar_after``); else the answer may open one itself first, or
    not (``grammar_after_open`` too: a model that writes its own ``<think>``). ``prefill``: the final
    assistant message the prompt ends with, continued (``opens_thinking``). ``params`` as they are
    without a reasoning parser or a grammar."""
    reasoning = server.reasoning_parser
    if reasoning is None or not any(kind in params for kind in GRAMMAR_KINDS):
        return params
    if opens_thinking(server, prompt, prefill):
        return {**params, "grammar_after": reasoning.end}
    return {**params, "grammar_after": reasoning.end, "grammar_after_open": reasoning.start}


def output_budget(engine: Engine, prompt_len: int, requested: int | None, max_param: str, prompt_param: str) -> int:
    """The engine's max_new_tokens: ``requested``, or where the request sets none, up to the context length and
    at most the model's ``generation_config.json`` ``max_new_tokens`` (vLLM's default ``max_tokens``). A prompt
    that leaves no room is a 400 naming the field to change (checked here, before the engine walks the ids)."""
    context = engine.context_length
    if prompt_len >= context:
        raise APIError(400, f"the prompt has {prompt_len} tokens; the context length is {context}",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        default = getattr(engine, "default_max_new_tokens", None)
        return context - prompt_len if default is None else min(default, context - prompt_len)
    if prompt_len + requested > context:
        raise APIError(400, f"the prompt ({prompt_len} tokens) + {max_param} ({requested}) exceeds the context "
                            f"length ({context})", param=max_param, code="context_length_exceeded")
    return requested


def budget_limit(engine: Engine, prompt_len: int, requested: int | None, max_param: str) -> str:
    """What sets ``output_budget``'s answer, in a message's words: the field, the model's default, or the context."""
    if requested is not None:
        return max_param
    default = getattr(engine, "default_max_new_tokens", None)
    if default is not None and default < engine.context_length - prompt_len:
        return f"the default {max_param} (the model's generation_config.json max_new_tokens)"
    return "the tokens the context leaves after the prompt"


def admit_chat(server: Server, model: str) -> Engine:
    """The engine for a conversation addressed to ``model`` (``Server.check_model``, ``admit``): a 400
    when the model has no tokenizer, so no chat template (chat completions, responses)."""
    server.check_model(model)
    engine = server.admit()
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template: use /v1/completions with token ids")
    return engine


REQUEST_ID_HEADER = "x-request-id"  # vLLM's tracing id: starts a request's engine ids (job_rids), echoed (app.py)


def job_rids(rid: str | list[str] | None, header: str | None, count: int) -> list[str | None]:
    """The engine request ids of a request's ``count`` jobs (its choices; a completion's prompt by prompt,
    ``n`` each), which ``/abort_request`` aborts by and the log names: SGLang's body ``rid`` (a string for
    one job, else a list of distinct ids, one per job), else, where the ``X-Request-Id`` header (vLLM's
    tracing id) is given, ``<id>-<i>-<8 hex>`` (the log finds them by the header's id; a client that sends
    one id twice at once, a retry, gets no clash), else none (the server makes them). A 400 naming ``rid``
    for ids that do not fit; one in use by a running request is the engine's 400."""
    if rid is None:
        if not header:
            return [None] * count
        return [f"{header}-{i}-{uuid.uuid4().hex[:8]}" for i in range(count)]
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != count:
        raise APIError(400, f"rid has {len(rids)} id(s) for {count} choices: give one per choice (a list; a "
                            "completion's prompt by prompt, n each)", param="rid")
    if not all(rids) or len(set(rids)) < len(rids):
        raise APIError(400, "rid ids must be non-empty and distinct", param="rid")
    return rids


def kept_markers(server: Server, body: ChatCompletionRequest) -> dict[str, bool]:
    """``{"skip_special_tokens": False}`` where a marker the server parses out of this chat's output is a
    special token of the model's tokenizer (the tool-call parser's, when the request has tools; the
    reasoning parser's): decoding would drop it before the parser sees it, and the calls or the thinking
    would be lost (vLLM turns skip_special_tokens off for such parsers too); else ``{}``."""
    tokenizer = server.admit().tokenizer
    markers = []
    if body.tool_choice_mode() != "none":
        markers += server.tool_call_parser.markers
    if server.reasoning_parser is not None:
        markers += [server.reasoning_parser.start, server.reasoning_parser.end]
    if tokenizer is not None and any(tokenizer.is_special_token(m) for m in markers):
        return {"skip_special_tokens": False}
    return {}


def forced_tool_grammar(server: Server, body: ChatCompletionRequest) -> dict[str, str]:
    """The sampling parameters that force a chat request's tool call (``tool_choice`` ``required`` or a
    named function: an ``ebnf`` grammar of the parser's call syntax); ``{}`` when none is forced."""
    forced = body.forced_tools()
    if not forced:
        return {}
    parallel = body.parallel_tool_calls and body.tool_choice_mode() == "required"
    try:  # (the request's tools are checked when it is parsed: a safety net)
        return {"ebnf": server.tool_call_parser.forced_grammar(forced, parallel)}
    except ValueError as exc:
        raise APIError(400, str(exc), param=body.forced_tool_field()) from exc


def truncate_prompt(body: CompletionRequest | ChatCompletionRequest, ids: list[int], context_length: int,
                    max_new_tokens: int | None) -> list[int]:
    """``truncate_prompt_tokens`` (vLLM's): the last N of the prompt's ``ids`` (all of them when no
    more). vLLM's bound: N is at most the context length less the requested output tokens
    (``max_new_tokens``, unset: 0), else a 400 naming the field; ``-1`` is that bound."""
    n = body.truncate_prompt_tokens
    if n is None:
        return ids
    limit = context_length - (max_new_tokens or 0)
    if n > limit:
        raise APIError(400, f"truncate_prompt_tokens ({n}) must be at most the context length ({context_length}) "
                            f"less the requested output tokens ({max_new_tokens or 0}): {limit}",
                       param="truncate_prompt_tokens")
    keep = limit if n == -1 else n
    return ids[-keep:] if 0 < keep < len(ids) else ids  # (-1 with no room left: the output's 400 follows)


def truncate_chat(encoding: ChatEncoding, ids: list[int]) -> ChatEncoding:
    """``encoding`` with its prompt cut to ``ids``, its last tokens (``truncate_prompt``): the message
    ends still inside it, moved with the cut."""
    cut = len(encoding.ids) - len(ids)
    if not cut:
        return encoding
    return ChatEncoding(text=encoding.text, ids=ids, boundaries=[b - cut for b in encoding.boundaries if b > cut])


def _token_ids(body: CompletionRequest, prompt_ids: list[int] | None, output_ids: list[int]) -> dict[str, Any]:
    """A completion choice's ``return_token_ids`` fields (vLLM's): ``prompt_token_ids`` (where given:
    a stream sends them in a choice's first chunk) and ``token_ids``; none unless asked for."""
    if not body.return_token_ids:
        return {}
    return {"prompt_token_ids": list(prompt_ids) if prompt_ids is not None else None, "token_ids": list(output_ids)}


def _check_min_tokens(min_tokens: int | None, max_new: int, limit: str) -> None:
    """``min_tokens`` may not exceed the tokens the request may generate, ``max_new`` (``limit`` says
    what sets it: a field, or the context): a 400 naming ``min_tokens``."""
    if min_tokens is not None and min_tokens > max_new:
        raise APIError(400, f"min_tokens ({min_tokens}) must be at most {limit} ({max_new})", param="min_tokens")


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> TokenText:
    return tokenizer.token_text(token_id) if tokenizer is not None else TokenText(f"token_id:{token_id}", [])


class TextOffsets:
    """Where each token of one sequence starts in its text (OpenAI's ``text_offset``): after the
    characters that the tokens before it decode to. A character split across tokens (the bytes of
    ``日``, of an emoji) counts once it is complete: the tokens holding its first bytes advance the
    offset by nothing, the one completing it by the character; so the offsets never pass the text
    and each token's span is the text it adds. A token the text leaves out (a special token with
    ``skip_special_tokens``) adds nothing either.

    Incremental: ``advance`` over a stream's chunks one after another gives the offsets one
    ``advance`` of all its ids gives. A byte-level BPE tokenizer's text is its tokens' bytes
    decoded (invalid bytes as U+FFFD), so the tokens' bytes go through an incremental UTF-8
    decoder: exact, and O(1) a token. Any other tokenizer's text is decoded over a window of ids, as
    ``IncrementalDetokenizer`` decodes it: ``context_ids`` (a completion's prompt: its last few ids)
    come first, and a U+FFFD at the end of the window's text is a character still incomplete.
    ``start``: the first token's offset. Without a tokenizer there is no text: every offset is
    ``start``."""

    def __init__(self, tokenizer: Tokenizer | None, context_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 start: int = 0):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.offset = start  # where the next token starts
        self._utf8 = None
        if tokenizer is None:
            return
        if isinstance(tokenizer.backend.decoder, decoders.ByteLevel):
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            self._skipped = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
            return
        context = list(context_ids)[-PROMPT_CONTEXT_TOKENS:]
        while context and REPLACEMENT_CHAR in self._decode(context):
            context = context[1:]  # start at a character boundary (as the detokenizer does)
        self._last, self._pending = context, []
        self._last_text = self._decode(context)
        self._counted = 0  # characters of the pending ids' text already in ``offset``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def advance(self, token_ids: Iterable[int]) -> list[int]:
        """The offsets of ``token_ids``, the sequence's next tokens."""
        out = []
        for tid in token_ids:
            out.append(self.offset)
            if self._utf8 is not None:
                data = b"" if tid in self._skipped else bytes(self.tokenizer.token_text(tid).bytes)
                self.offset += len(self._utf8.decode(data))
            elif self.tokenizer is not None:
                self._advance_window(tid)
        return out

    def _advance_window(self, tid: int) -> None:
        self._pending.append(tid)
        new = self._decode(self._last + self._pending)[len(self._last_text):]
        # U+FFFD at the end: a character still incomplete (unless too many ids hold it: invalid bytes)
        incomplete = new.endswith(REPLACEMENT_CHAR) and len(self._pending) < MAX_PENDING_IDS
        complete = len(new.rstrip(REPLACEMENT_CHAR)) if incomplete else len(new)
        self.offset += max(0, complete - self._counted)
        self._counted = max(self._counted, complete)
        if not incomplete:  # all complete: slide the window
            self._last, self._pending, self._counted = self._pending, [], 0
            self._last_text = self._decode(self._last)


def completion_logprobs(tokenizer: Tokenizer | None, lps: Logprobs, tops: TopLogprobs, offsets: TextOffsets,
                        end: int | None = None) -> CompletionLogprobs:
    """OpenAI's legacy logprobs of the next tokens of a sequence (``offsets``: its ``TextOffsets``).
    ``top_logprobs`` always holds the token itself beside its alternatives (OpenAI's "up to
    logprobs+1 elements", as vLLM), so ``logprobs: 0`` gives the token alone; a token without a
    logprob (a prompt's first) has null. ``end``: the length of the text, where known (a stop string
    cuts the text before the tokens that hold it): no offset goes past it."""
    out = CompletionLogprobs()
    starts = offsets.advance(tid for _, tid in lps)
    for i, ((lp, tid), start) in enumerate(zip(lps, starts)):
        text = _token_text(tokenizer, tid).text
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        top = {_token_text(tokenizer, t).text: v for v, t in (tops[i] if i < len(tops) else None) or ()}
        if lp is not None:  # (an alternative with the same text is the token itself: one entry)
            top.setdefault(text, lp)
        out.top_logprobs.append(top or None)
        out.text_offset.append(start if end is None else min(start, end))
    return out


def _take_started(held: CompletionLogprobs, end: int, final: bool) -> CompletionLogprobs:
    """The first tokens of ``held`` that start within the first ``end`` characters of the text (the
    text sent so far; ``final``: all of them, none starting past ``end``), taken out of ``held``."""
    k = len(held.tokens) if final else bisect.bisect_right(held.text_offset, end)
    out = CompletionLogprobs(tokens=held.tokens[:k], token_logprobs=held.token_logprobs[:k],
                             top_logprobs=held.top_logprobs[:k], text_offset=[min(o, end) for o in held.text_offset[:k]])
    for values in (held.tokens, held.token_logprobs, held.top_logprobs, held.text_offset):
        del values[:k]
    return out


def chat_logprobs(tokenizer: Tokenizer | None, lps: Logprobs, tops: TopLogprobs) -> ChatChoiceLogprobs:
    content = []
    for i, (lp, tid) in enumerate(lps):
        token = _token_text(tokenizer, tid)
        top = []
        for v, t in tops[i] if i < len(tops) else []:
            alt = _token_text(tokenizer, t)
            top.append(TopLogprob(token=alt.text, logprob=v, bytes=alt.bytes))
        content.append(ChatTokenLogprob(token=token.text, logprob=lp, bytes=token.bytes, top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


def _prompt_text(engine: Engine, prompt: str | list[int]) -> str:
    """What ``echo`` puts before the completion: the prompt as sent (token ids decoded)."""
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt) if engine.tokenizer is not None else ""


def _prompt_logprobs(tokenizer: Tokenizer | None, choice: Choice, prompt: str | list[int],
                     echoed: str) -> CompletionLogprobs:
    """``echo`` + ``logprobs``: the prompt tokens' logprobs (the first token's is null), their offsets
    in ``echoed``, the prompt's text (``_prompt_text``: a text prompt as sent, special-token text
    included; token ids decoded without their special tokens)."""
    lps = [(lp, tid) for lp, tid, _ in choice.input_logprobs or ()]
    offsets = TextOffsets(tokenizer, skip_special_tokens=not isinstance(prompt, str))
    return completion_logprobs(tokenizer, lps, choice.input_top_logprobs or [], offsets, end=len(echoed))


def choice_logprobs(choice: Choice) -> tuple[Logprobs, TopLogprobs]:
    """A finished choice's ``(logprob, token_id)`` per token and top alternatives."""
    return [(lp, tid) for lp, tid, _ in choice.token_logprobs or ()], choice.top_logprobs or []


def usage(choices: list[Choice], n: int) -> UsageInfo:
    """Usage of ``len(choices) // n`` prompts with ``n`` choices each: a prompt counts once, and its
    cached tokens are the fewest any of its choices had (what the prompt itself hit)."""
    prompt = cached = completion = 0
    for start in range(0, len(choices), n):
        group = choices[start:start + n]
        prompt += group[0].meta.get("prompt_tokens", 0)
        cached += min(c.meta.get("cached_tokens", 0) for c in group)
        completion += sum(c.meta.get("completion_tokens", 0) for c in group)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
