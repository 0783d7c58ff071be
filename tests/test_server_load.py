"""64 concurrent streaming clients, a quarter of which disconnect early: every request finishes or
is aborted, the server stays up, and afterwards every pool slot is free or held by the prefix tree."""

from __future__ import annotations

import asyncio

import openai
import pytest

from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from test_server_errors import assert_pools_clean, wait_until_idle
from test_server_openai import MODEL, make_chat_model

NUM_CLIENTS = 64
MAX_TOKENS = 12
SYSTEMS = [f"You are assistant number {i}. Keep answers short." for i in range(4)]  # shared prefixes


async def _client_session(client: openai.AsyncOpenAI, i: int) -> tuple[str, str, int]:
    """One streaming chat. Every 4th client reads two chunks and hangs up. Returns (outcome,
    finish_reason, number of content chunks)."""
    messages = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0.7, seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    finish, chunks, usage = None, 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            chunks += 1
            finish = c.finish_reason or finish
        if i % 4 == 3 and chunks >= 2:
            await stream.close()
            return "disconnected", "", chunks
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    return "finished", finish, chunks


@pytest.mark.slow
def test_64_concurrent_streaming_clients_some_disconnecting(tiny_ckpt_dir):
    app = create_app(make_chat_model(tiny_ckpt_dir), served_model_name=MODEL, max_total_tokens=32768,
                     max_state_slots=256, max_running_requests=64, chunked_prefill_size=1024)

    async def run_all(url: str) -> list:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(_client_session(client, i) for i in range(NUM_CLIENTS)),
                                        return_exceptions=True)

    with BackgroundServer(app) as srv:
        engine = srv.app.state.server.engine
        results = asyncio.run(run_all(srv.url))
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        finished = [r for r in results if r[0] == "finished"]
        disconnected = [r for r in results if r[0] == "disconnected"]
        assert len(finished) == NUM_CLIENTS * 3 // 4 and len(disconnected) == NUM_CLIENTS // 4
        assert all(reason == "length" for _, reason, _ in finished)
        wait_until_idle(engine, timeout=30)
        stats = engine.get_stats()
        assert stats["num_requests_finished"] == NUM_CLIENTS
        # the disconnected clients' requests were cut short
        assert stats["num_generated_tokens"] < NUM_CLIENTS * MAX_TOKENS
        assert stats["num_cached_tokens"] > 0  # the shared system prompts hit
        assert_pools_clean(engine)
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still up?"}],
                                                   max_tokens=3, temperature=0)
        assert again.usage.completion_tokens >= 1
