"""What the engine raises at a caller: a request it refuses, and a full queue.

``RequestError`` is a ``ValueError`` (what the library promises for bad input) that also names the
request field at fault, ``param``, in the engine's own words (``max_new_tokens``, ``logit_bias``,
``input_ids``, ...): the server answers it 400 with OpenAI's ``param`` in the API's words
(``hyla.server.errors.api_param``).
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; ``param``: the field at fault (None when no one field is)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; retry later (the server answers 429 with Retry-After)."""
