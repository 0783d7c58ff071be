"""A request's text through ``OutputProcessor`` (no model: output ids are appended as if sampled):
stop tokens, stop strings, ``min_new_tokens``, ``include_stop_str_in_output`` and
``skip_special_tokens`` against a plain reference written with whole decodes, streamed and not, for
a byte-level BPE tokenizer (the default model's) and a byte-fallback SentencePiece one."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyla.engine.output_processor import OutputProcessor
from hyla.engine.request import Req, ReqStatus
from hyla.engine.sampling_params import SamplingParams
from hyla.tokenizer import REPLACEMENT_CHAR, Tokenizer
from hyla.tokenizer.detokenizer import MAX_PENDING_IDS
from hyla.tokenizer.token_text import BYTE_LEVEL_ALPHABET
from test_tokenizer import DEFAULT_MODEL, build_sentencepiece_style_dir, window_reference


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_sentencepiece_style_dir(tmp_path_factory.mktemp("sp_review")))


def run(tok: Tokenizer, prompt: list[int], ids: list[int], params: dict[str, Any], stream: bool,
        eos: tuple[int, ...] = ()) -> tuple[Req, list[dict[str, Any]]]:
    """Append ``ids`` one at a time (as decode steps do) until the request finishes; a request not
    finished by then ends as the engine ends it at its length limit. Returns it and its chunks."""
    chunks: list[dict[str, Any]] = []
    req = Req("r", list(prompt), SamplingParams(**{"max_new_tokens": 1000, **params}), stream=stream,
              return_logprob=True, on_output=lambda chunk, done: chunks.append(chunk))
    req.status = ReqStatus.RUNNING
    op = OutputProcessor(eos, 10**9, make_detokenizer=lambda r: tok.detokenizer(r.input_ids, r.sampling.skip_special_tokens))
    for i, t in enumerate(ids):
        op.append(req, [t], [-float(i)], [[]])
        if req.finished:
            break
        if req.stream:
            op.deliver(req)
    if not req.finished:
        op.set_finished(req, {"type": "length", "length": len(req.output_ids)})
    op.deliver(req)
    return req, chunks


def reference(tok: Tokenizer, prompt: list[int], ids: list[int], params: dict[str, Any],
              eos: tuple[int, ...] = ()) -> tuple[str, int, Any]:
    """(text, number of output ids, what ended it) by whole decodes: ``shown(k)`` is the text of the
    first ``k`` ids that is final (an unfinished character at the end held back), ``full(k)`` that
    text with the held back part decoded as ``decode`` does (U+FFFD). A stop token ends the output
    with ``full`` of the ids before it (of the ids with it, with ``include_stop_str_in_output``); a
    stop string ending in the new text of token ``min_new_tokens`` or a later one cuts ``shown``
    at its start (at its end, with ``include_stop_str_in_output``); the earliest match wins."""
    skip = params.get("skip_special_tokens", True)
    include = params.get("include_stop_str_in_output", False)
    stops, min_new = params.get("stop", []), params.get("min_new_tokens", 0)
    ending = set(params.get("stop_token_ids", [])) | (set() if params.get("ignore_eos") else set(eos))

    def chunks(k: int) -> list[str]:
        detok = tok.detokenizer(prompt, skip_special_tokens=skip)
        return [detok.step(i) for i in ids[:k]] + [detok.flush()]

    def shown(k: int) -> str:
        return "".join(chunks(k)[:-1])

    def full(k: int) -> str:
        return "".join(chunks(k))

    for k in range(1, len(ids) + 1):
        if ids[k - 1] in ending and k >= min_new:
            return (full(k) if include else full(k - 1)), k, ids[k - 1]
        if stops and k >= min_new:
            text, before = shown(k), len(shown(k - 1))
            hits = [(pos, s) for s in stops if (pos := text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                pos, s = min(hits)
                return text[:pos + len(s)] if include else text[:pos], k, s
    return full(len(ids)), len(ids), None


def check(tok: Tokenizer, prompt: list[int], ids: list[int], params: dict[str, Any], eos: tuple[int, ...] = ()) -> None:
    """The text, streamed and not, is the reference's, and the ids and logprobs stay aligned."""
    want_text, n, matched = reference(tok, prompt, ids, params, eos)
    for stream in (False, True):
        req, chunks = run(tok, prompt, ids, params, stream, eos)
        text = "".join(c["text"] for c in chunks)
        assert (text, req.text) == (want_text, want_text), (stream, params)
        assert req.output_ids == ids[:n] == [i for c in chunks for i in c["output_ids"]]
        logprobs = [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]]
        assert logprobs == [(-float(i), t, None) for i, t in enumerate(ids[:n])]
        reason = chunks[-1]["meta_info"]["finish_reason"]
        assert reason.get("matched") == matched


def test_stop_token_after_an_unfinished_character_keeps_the_text_before_it(tok: Tokenizer) -> None:
    """A stop token right after the first bytes of a character: the output is the decode of the ids
    before it (its held-back end as U+FFFD), streamed or not. (The text held back for the unfinished
    character was dropped together with the stop token's: all of a non-streamed output's text.)"""
    prompt = tok.encode("Q: x")
    start = tok.encode("a 🦜")[:-1]  # "a", " ", and two of the parrot's byte tokens
    assert tok.decode(start) == "a " + REPLACEMENT_CHAR
    dot, end = tok.encode(".")[0], tok.token_to_id("<|im_end|>")
    for params, eos in [({"stop_token_ids": [dot]}, ()), ({}, (end,)), ({"skip_special_tokens": False}, (end,)),
                        ({"stop_token_ids": [dot], "include_stop_str_in_output": True}, ())]:
        ids = start + [dot if params.get("stop_token_ids") else end]
        want = tok.decode(ids if params.get("include_stop_str_in_output") else start)
        for stream in (False, True):
            req, chunks = run(tok, prompt, ids, params, stream, eos)
            assert req.text == "".join(c["text"] for c in chunks) == want, (params, stream)
        check(tok, prompt, ids, params, eos)


SAMPLES = ["Hello, world! 你好 🦜 café done.", "a🙂b🙂c 中文 test<|im_end|> more text", " x  y\n\nz 𝄞 end", "the cat sat on the mat"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_and_stops_equal_the_whole_decode_reference(tok: Tokenizer, sp_tok: Tokenizer, data) -> None:
    """Fuzz: output ids of real text with random ids mixed in (bytes of broken characters, special
    tokens), stop strings cut from the output's own text (prefixes of each other, across tokens, at
    the first token), stop token ids, EOS, ``min_new_tokens``, both ``skip_special_tokens`` and
    ``include_stop_str_in_output``: streamed and whole texts equal the reference."""
    t = data.draw(st.sampled_from([tok, sp_tok]))
    ids = t.encode(data.draw(st.sampled_from(SAMPLES)), add_special_tokens=False)
    # byte-fallback decodes each byte token of invalid UTF-8 as U+FFFD, so that its text depends on
    # how the ids are grouped (the detokenizer's known limit): there random ids are no byte tokens,
    # and go between characters
    lowest = 0 if t is tok else 3 + 256
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(ids)))
        if t is sp_tok and REPLACEMENT_CHAR in t.decode(ids[:at], skip_special_tokens=False):
            continue
        ids[at:at] = data.draw(st.lists(st.integers(lowest, t.vocab_size - 1), min_size=1, max_size=3))
    prompt = data.draw(st.sampled_from([t.encode("Q: x", add_special_tokens=False), ids[:2] or [5], [5]]))
    skip = data.draw(st.booleans())
    whole = t.decode(ids, skip_special_tokens=skip)
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        a = data.draw(st.integers(0, max(0, len(whole) - 1)))
        stops.append(whole[a:a + data.draw(st.integers(1, 5))] or "zz")
    if stops and data.draw(st.booleans()):
        stops.append(stops[0][:1])  # a prefix of another stop string
    params = {"stop": stops, "skip_special_tokens": skip, "include_stop_str_in_output": data.draw(st.booleans()),
              "min_new_tokens": data.draw(st.integers(0, 3)), "max_new_tokens": max(3, len(ids))}
    candidates = [i for i in ids if i >= lowest]  # (a byte-fallback stop token would cut a character)
    if candidates and data.draw(st.booleans()):
        params["stop_token_ids"] = [data.draw(st.sampled_from(candidates))]
    eos = (2,) if data.draw(st.booleans()) else ()
    params["ignore_eos"] = data.draw(st.booleans())
    check(t, prompt, ids, params, eos)


# --- the detokenizer's window stays short ---------------------------------------------------------


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """The byte-level BPE tokenizer's 256 single-byte tokens, by byte."""
    char_of = {b: c for c, b in BYTE_LEVEL_ALPHABET.items()}
    return [tok.token_to_id(char_of[b]) for b in range(256)]


def test_window_stays_short_on_text_that_never_completes(tok: Tokenizer) -> None:
    """Ids that hold text back forever — special tokens skipped (a model repeating EOS under
    ``ignore_eos``), lone continuation bytes (U+FFFD for good) — no longer pile up in the window:
    every step decoded all of them (quadratic time on the scheduler thread), and the stream showed
    nothing of the invalid bytes until the end."""
    eos, lone = tok.token_to_id("<|endoftext|>"), byte_token_ids(tok)[0x80]
    detok = tok.detokenizer(tok.encode("Q: x"))
    assert [detok.step(eos) for _ in range(300)] == [""] * 300
    assert len(detok._last) + len(detok._pending) <= MAX_PENDING_IDS + 5
    assert detok.step(tok.encode(" ok")) == " ok"
    chunks = [detok.step(lone) for _ in range(300)]
    assert len(detok._last) + len(detok._pending) <= 2 * MAX_PENDING_IDS
    chunks += [detok.step(tok.encode(" 你好")), detok.flush()]
    assert "".join(chunks) == REPLACEMENT_CHAR * 300 + " 你好"
    assert len(chunks[-2]) < 30  # the U+FFFD came as the ids did, not all at the end
    # a character split over byte tokens while the window gives up its text: every offset of its
    # bytes against the cap, the text still adds up to decode's
    byte_ids = byte_token_ids(tok)
    for n in range(MAX_PENDING_IDS, 2 * MAX_PENDING_IDS + 4):
        ids = [lone] * n + [byte_ids[b] for b in "你好🦜".encode()]
        detok = tok.detokenizer(tok.encode("Q: x"))
        assert "".join([detok.step(i) for i in ids] + [detok.flush()]) == tok.decode(ids), n


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_long_runs_of_bytes_and_special_tokens_equal_the_whole_decode(tok: Tokenizer, data) -> None:
    """Long outputs of byte tokens (valid characters split across them, invalid runs), special and
    out-of-vocabulary ids and some text, streamed in steps of 1 to 3 ids: the chunks add up to
    ``decode`` (with and without ``skip_special_tokens``), and none ends mid-character."""
    byte_ids = byte_token_ids(tok)
    pieces = st.one_of(
        st.lists(st.sampled_from(byte_ids), min_size=1, max_size=12),
        st.text(max_size=3).map(lambda s: [byte_ids[b] for b in s.encode()]),
        st.sampled_from([[i] for i in tok.all_special_ids] + [[tok.vocab_size + 7]]),
        st.sampled_from(["中", " the", "🦜!", "é"]).map(lambda s: tok.encode(s)),
    )
    ids = [i for p in data.draw(st.lists(pieces, max_size=20)) for i in p]
    skip = data.draw(st.booleans())
    prompt = data.draw(st.sampled_from([tok.encode("Q: x"), [byte_ids[0xE4]]]))
    detok = tok.detokenizer(prompt, skip_special_tokens=skip)
    chunks, pos = [], 0
    while pos < len(ids):
        n = data.draw(st.integers(1, 3))
        chunks.append(detok.step(ids[pos:pos + n]))
        pos += n
    chunks.append(detok.flush())
    context = tok.decode(detok.ids[:detok.num_context_ids], skip_special_tokens=skip)
    assert "".join(chunks) == tok.decode(detok.ids, skip_special_tokens=skip)[len(context):]
    assert detok.output_ids == ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_long_byte_runs_equal_the_window_reference(tok: Tokenizer, sp_tok: Tokenizer, data) -> None:
    """Long runs of byte tokens (byte-level, or byte fallback ``<0x80>``), special ids between: chunk
    by chunk what the plain window (with its cap on held-back ids) gives."""
    t = data.draw(st.sampled_from([tok, sp_tok]))
    byte_ids = byte_token_ids(tok) if t is tok else [t.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    some = st.one_of(st.sampled_from(byte_ids), st.sampled_from(t.all_special_ids), st.integers(0, t.vocab_size + 3))
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_ids[0x80:]), some), max_size=60))
    prompt = data.draw(st.sampled_from([t.encode("hi", add_special_tokens=False), [byte_ids[0x41]]]))
    skip = data.draw(st.booleans())
    detok = t.detokenizer(prompt, skip_special_tokens=skip)
    assert [detok.step(i) for i in ids] + [detok.flush()] == window_reference(t, ids, prompt, skip)
