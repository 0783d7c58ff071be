"""``--log-requests``: a log line for each engine request as it ends (SGLang's flag and levels).

One idea: an operator sees what was served, request by request, in the server's log (logger
``hyla.server.requests``, level INFO), off by default (prompts and outputs are the users' data).
``--log-requests-level`` says how much (SGLang's levels):

* 0 — metadata: the request id (a chat's ``X-Request-Id`` starts it), the endpoint, why it ended
  (``stop`` and what matched, ``length``, ``abort`` and its cause), its prompt, cached and output
  tokens, the time to its first token and to its end (from the HTTP request's arrival);
* 1 — and its sampling parameters;
* 2 (the default) — and its prompt and output, the first ``PARTIAL_CHARS`` characters of each;
* 3 — and its whole prompt and output.

A prompt the endpoint tokenized (a chat's rendered conversation) is shown decoded, special tokens
included: what the model read. Texts are written as JSON strings, so a line is one line whatever
they hold.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger("hyla.server.requests")

LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
DEFAULT_LOG_REQUESTS_LEVEL = 2
PARTIAL_CHARS = 2048  # level 2: the characters of a prompt or an output shown (SGLang's max length)


class RequestLog:
    """Writes one line per ended request at ``level`` (``LOG_REQUESTS_LEVELS``); ``ValueError`` for
    another level."""

    def __init__(self, level: int = DEFAULT_LOG_REQUESTS_LEVEL):
        if isinstance(level, bool) or level not in LOG_REQUESTS_LEVELS:
            raise ValueError(f"log_requests_level must be one of {LOG_REQUESTS_LEVELS}, got {level!r}")
        self.level = level

    def ended(self, endpoint: str, rid: str, prompt: str | list[int], sampling_params: dict[str, Any],
              meta: dict[str, Any], output: str, arrival: float, first_token: float | None, end: float,
              tokenizer: Any = None) -> None:
        """The line of request ``rid`` of ``endpoint``, ended at ``end`` (``time.monotonic``): the engine's
        ``meta`` (its counts and ``finish_reason``; none: the client went away first), its ``output`` text;
        ``tokenizer`` decodes a prompt given as token ids."""
        reason = meta.get("finish_reason") or {"type": "abort", "cause": "client"}
        why = reason["type"] + "".join(f" {k}={json.dumps(reason[k], ensure_ascii=False)}"
                                       for k in ("matched", "cause") if k in reason)
        prompt_tokens = meta.get("prompt_tokens", len(prompt) if isinstance(prompt, list) else "-")
        fields = [f"rid={rid}", f"endpoint={endpoint}", f"finish=({why})", f"prompt_tokens={prompt_tokens}",
                  f"cached_tokens={meta.get('cached_tokens', 0)}", f"completion_tokens={meta.get('completion_tokens', 0)}",
                  f"ttft={first_token - arrival:.3f}s" if first_token is not None else "ttft=-",
                  f"e2e={end - arrival:.3f}s"]
        if self.level >= 1:
            fields.append(f"sampling_params={json.dumps(sampling_params, ensure_ascii=False, default=str)}")
        if self.level >= 2:
            fields += [f"prompt={self._prompt(prompt, tokenizer)}", f"output={self._shown(output)}"]
        logger.info("request ended: %s", " ".join(fields))

    def _prompt(self, prompt: str | list[int], tokenizer: Any) -> str:
        """The prompt as shown: its text, or its token ids decoded (the first ``PARTIAL_CHARS`` below level 3;
        as ids without a tokenizer)."""
        if isinstance(prompt, str):
            return self._shown(prompt)
        ids = prompt if self.level >= 3 else prompt[:PARTIAL_CHARS]  # (a token is a character or more, mostly)
        more = f" (+{len(prompt) - len(ids)} more tokens)" if len(ids) < len(prompt) else ""
        if tokenizer is None:
            return json.dumps(ids) + more
        return self._shown(tokenizer.decode(ids, skip_special_tokens=False)) + more

    def _shown(self, text: str) -> str:
        """``text`` as a JSON string, its first ``PARTIAL_CHARS`` characters below level 3."""
        if self.level >= 3 or len(text) <= PARTIAL_CHARS:
            return json.dumps(text, ensure_ascii=False)
        return json.dumps(text[:PARTIAL_CHARS], ensure_ascii=False) + f" (+{len(text) - PARTIAL_CHARS} more characters)"
