"""A streamed request's chunks, as the caller iterates them (``Engine.generate(stream=True)`` and
``async_generate``'s).

The contract: the request runs until it ends or until its consumer stops listening, whichever
comes first. A consumer stops listening by closing the stream (``close()`` / ``aclose()``, or
breaking out of a ``for`` loop over it), or by dropping it unfinished — also before its first
chunk, which a generator function could not see (its ``finally`` never runs if it never
started): an abandoned request must not hold a running slot and the device until its last token.

Both iterators abort through ``abort_soon`` (``Engine._abort_soon``, given the request itself: an abort that
arrives after the request ended finds nothing, even where a new request has taken its id), which only puts a command on
the engine's inbox (a ``queue.SimpleQueue``, whose ``put`` may run inside a finalizer: it takes no
lock a collected object could hold). Whether the request has ended is known from the scheduler's
side (``_Ending.ended``, set by the sink callback when its last chunk is delivered), not from what
the consumer read: a stream dropped after its request ended with the last chunk unread aborts
nothing (the request id may already belong to a new request).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any, Callable


class _Ending:
    """Whether the request's last chunk has been delivered. The sink callback holds this, not the
    stream: a callback that held the stream would keep it alive while the request runs (the
    request holds the callback), and dropping it would then abort nothing."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False


class _Stream:
    """What both streams share: the request id, whether it has ended, and aborting on close."""

    def __init__(self, rid: str, abort_soon: Callable[[Any], None], handle: Any):
        self.rid = rid
        self._abort_soon = abort_soon
        self._handle = handle  # what abort_soon is given: the request itself
        self._ending = _Ending()
        self._done = False  # the consumer has read the last chunk (or closed the stream)

    @staticmethod
    def _on_output(ending: _Ending, put: Callable[[tuple[dict[str, Any], bool]], None]
                   ) -> Callable[[dict[str, Any], bool], None]:
        """The request's ``on_output`` (runs on the scheduler thread): notes the end, hands the chunk
        on. A static method: the callback must not hold the stream (see ``_Ending``)."""
        def on_output(chunk: dict[str, Any], done: bool) -> None:
            if done:
                ending.ended = True
            put((chunk, done))
        return on_output

    def never_submitted(self) -> None:
        """The request was refused at submission (its id in use, a full queue): closing or dropping the
        stream aborts nothing (the id may be another live request's)."""
        self._done = True

    def close(self) -> None:
        """Stop listening: abort the request unless it has ended. Idempotent."""
        if not self._done:
            self._done = True
            if not self._ending.ended:  # (it may end before the abort arrives: the abort then finds it gone,
                self._abort_soon(self._handle)  # as the handle is the request, not its rid, which may be reused)

    def __del__(self) -> None:
        self.close()


class RequestStream(_Stream):
    """The chunks of one streamed request (a sync iterator); ``close()`` or dropping it unfinished
    aborts the request."""

    def __init__(self, rid: str, abort_soon: Callable[[Any], None], handle: Any):
        super().__init__(rid, abort_soon, handle)
        self._sink: queue.SimpleQueue = queue.SimpleQueue()

    def sink(self) -> Callable[[dict[str, Any], bool], None]:
        """The request's ``on_output``."""
        return self._on_output(self._ending, self._sink.put)

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._done:
            raise StopIteration
        chunk, self._done = self._sink.get()
        return chunk


class AsyncRequestStream(_Stream):
    """The chunks of one streamed request (an async iterator); chunks that arrived while the
    consumer was busy come merged into one (a client slower than decoding reads fewer, larger
    chunks). ``aclose()`` or dropping it unfinished aborts the request; so does a consumer
    cancelled while it waits for a chunk."""

    def __init__(self, rid: str, abort_soon: Callable[[Any], None], handle: Any, loop: asyncio.AbstractEventLoop):
        super().__init__(rid, abort_soon, handle)
        self._loop = loop
        self._sink: asyncio.Queue = asyncio.Queue()

    def sink(self) -> Callable[[dict[str, Any], bool], None]:
        """The request's ``on_output`` (hands the chunk to the event loop)."""
        loop, put = self._loop, self._sink.put_nowait
        return self._on_output(self._ending, lambda item: loop.call_soon_threadsafe(put, item))

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        try:
            chunk, done = await self._sink.get()
        except BaseException:  # cancelled while waiting: nobody will read the rest
            self.close()
            raise
        while not done and not self._sink.empty():  # coalesce what arrived meanwhile
            more, done = self._sink.get_nowait()
            chunk = merge_chunks(chunk, more)
        self._done = done
        return chunk

    async def aclose(self) -> None:
        self.close()


def merge_chunks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One stream chunk holding ``a`` then ``b``: ``b``'s counts and finish reason, both chunks'
    output logprobs, and what only ``a`` carries (the first chunk's prompt logprobs, which were lost
    when a client slower than decoding got its first chunk merged with the next)."""
    meta = {**a["meta_info"], **b["meta_info"]}
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in b["meta_info"]:
            meta[key] = a["meta_info"][key] + b["meta_info"][key]
    return {"text": a["text"] + b["text"], "output_ids": a["output_ids"] + b["output_ids"], "meta_info": meta}
