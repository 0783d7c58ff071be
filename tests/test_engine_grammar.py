"""Structured outputs: ``json_schema`` / ``regex`` / ``ebnf`` sampling parameters.

Outputs of the built-in default model (trained, with a tokenizer) must satisfy their grammar,
greedy and sampled, batched with unconstrained requests (whose outputs do not change), with the
prefix cache on and off (identical), with speculation on (greedy: identical; drafts checked against
the grammar), streamed; a grammar that cannot compile is a ``ValueError`` at submission (a 400 on
the native API). The unit tests pin the mask contract: EOS allowed exactly where the grammar may
end, ids beyond the tokenizer masked, draft rows equal to the masks after accepting each draft.
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
import torch

import checkpoints
from hyla import Engine
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.engine.grammar import Grammars, apply_token_mask, grammar_source, unpack_bitmask
from hyla.engine.sampling_params import SamplingParams
from hyla.server.app import create_app
from hyla.server.launch import BackgroundServer
from hyla.tokenizer import Tokenizer
from test_engine_differential import compare_outputs
from test_engine_speculative import OracleDrafter

POOLS = dict(max_total_tokens=8192, max_state_slots=64, max_running_requests=8, chunked_prefill_size=256)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "ok"],
    "additionalProperties": False,
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
ANSWER = r"(yes|no), [a-z]{1,10}\."
YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"'
LARK = 'start: "[" NUM ("," NUM){0,3} "]"\nNUM: /[0-9]{1,3}/'

PROMPTS = [
    "<|im_start|>user\nDescribe a user of the system as JSON.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhen was the company founded?<|im_end|>\n<|im_start|>assistant\n",
    "Here is a short answer:",
]


def check_schema(value, schema: dict, where: str = "$") -> None:
    """A tiny JSON-schema checker for the keywords the tests use."""
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), f"{where}: not an object"
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{where}: missing {key}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{where}: extra keys {set(value) - set(props)}"
        for key, v in value.items():
            if key in props:
                check_schema(v, props[key], f"{where}.{key}")
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", len(value)), where
        for i, v in enumerate(value):
            check_schema(v, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), where
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), where
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where
    elif kind == "boolean":
        assert isinstance(value, bool), where
    else:
        raise AssertionError(f"unsupported schema type {kind}")


def lark_ok(text: str) -> bool:
    return re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3}){0,3}\]", text) is not None


def assert_complete(out: dict) -> None:
    """The grammar finished the request: the last token completed it (or was EOS where it may end)."""
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}, out["meta_info"]


GREEDY = {"temperature": 0, "max_new_tokens": 96}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 96}


def constrained(i: int, base: dict) -> dict:
    """Request ``i`` of a mixed constrained workload: JSON schema, regexes, GBNF, Lark in turn."""
    kind = i % 5
    grammar = [{"json_schema": SCHEMA}, {"regex": DATE}, {"regex": ANSWER}, {"ebnf": YES_NO}, {"ebnf": LARK}][kind]
    return {**base, **grammar, "seed": 100 + i} if base["temperature"] else {**base, **grammar}


def check_output(i: int, out: dict) -> None:
    text = out["text"]
    kind = i % 5
    if kind == 0:
        check_schema(json.loads(text), SCHEMA)
    elif kind == 1:
        assert re.fullmatch(DATE, text), text
    elif kind == 2:
        assert re.fullmatch(ANSWER, text), text
    elif kind == 3:
        assert text in ("yes.", "no.", "maybe."), text
    else:
        assert lark_ok(text), text
    assert_complete(out)


@pytest.fixture(scope="module")
def engine():
    with Engine(debug_checks=True, **POOLS) as e:
        yield e


@pytest.fixture(scope="module")
def engine_off():
    with Engine(enable_prefix_cache=False, **POOLS) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


# --- outputs satisfy their grammar ---------------------------------------------------------------


@pytest.mark.parametrize("base", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_outputs_satisfy_their_grammar(engine, base):
    n = 10
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    outs = engine.generate(prompts, [constrained(i, base) for i in range(n)])
    for i, out in enumerate(outs):
        check_output(i, out)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_grammar_that_must_end_ends_before_min_new_tokens(engine, tokenizer, temperature):
    """``min_new_tokens`` bans the ids that end a request; where a grammar allows nothing else (it is
    complete, or its only next tokens are stop token ids) the ban yields, and the output still
    satisfies the grammar: before, every token was -inf and the argmax (0) or the last id was drawn,
    outside the grammar."""
    params = {"temperature": temperature, "max_new_tokens": 5, "seed": 3}
    out = engine.generate(PROMPTS[2], {**params, "regex": "y", "min_new_tokens": 3})
    assert out["text"] == "y"
    assert_complete(out)  # EOS where the grammar ends, though 3 tokens were asked for
    only_y = tokenizer.encode("y")
    assert len(only_y) == 1  # the built-in tokenizer spells "y" one way: the grammar's first token
    out = engine.generate(PROMPTS[2], {**params, "regex": "y", "stop_token_ids": only_y, "min_new_tokens": 2})
    assert out["output_ids"] == only_y and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": only_y[0]}
    engine.wait_idle()
    engine.check_integrity()


def test_json_schema_as_text_equals_as_object(engine):
    a = engine.generate(PROMPTS[0], {**GREEDY, "json_schema": SCHEMA})
    b = engine.generate(PROMPTS[0], {**GREEDY, "json_schema": json.dumps(SCHEMA, indent=2)})
    assert a["output_ids"] == b["output_ids"]
    assert SamplingParams(json_schema=SCHEMA).grammar == SamplingParams(json_schema=json.dumps(SCHEMA)).grammar


def test_json_layout_and_a_complete_output_is_a_stop(engine):
    out = engine.generate(PROMPTS[0], {**GREEDY, "json_schema": SCHEMA})
    doc = json.loads(out["text"])
    assert out["text"] == json.dumps(doc)  # the default layout: {"a": 1, "b": [2, 3]}
    n = len(out["output_ids"])
    exact = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": n, "json_schema": SCHEMA})
    assert exact["output_ids"] == out["output_ids"]
    assert_complete(exact)  # complete on its last allowed token: stop, not length
    short = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": n - 1, "json_schema": SCHEMA})
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": n - 1}


def test_logprobs_stay_the_raw_models(engine, tokenizer):
    """A fully forced output: masked logprobs would all be 0; the raw model's are not."""
    out = engine.generate(PROMPTS[2], {**GREEDY, "regex": "the grammar decides"}, return_logprob=True)
    assert out["text"] == "the grammar decides"
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert all(lp < -1e-3 for lp in lps)
    free = engine.generate(PROMPTS[2], {**GREEDY, "max_new_tokens": 1}, return_logprob=True)
    first = out["output_ids"][0]
    if free["output_ids"][0] == first:  # the same position, the same distribution
        assert abs(free["meta_info"]["output_token_logprobs"][0][0] - lps[0]) < 1e-4


# --- batching, prefix cache, speculation, streaming ----------------------------------------------


@pytest.mark.parametrize("base", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_unconstrained_neighbours_are_unchanged(engine, base):
    free = [{**base, "max_new_tokens": 24, "ignore_eos": True, **({"seed": 7 + i} if base["temperature"] else {})}
            for i in range(3)]
    prompts = PROMPTS[:3]
    alone = engine.generate(prompts, free, return_logprob=True)
    mixed = engine.generate(prompts + prompts, free + [constrained(i, base) for i in range(3)], return_logprob=True)
    for a, b in zip(alone, mixed[:3]):
        assert a["output_ids"] == b["output_ids"]
    compare_outputs(mixed[:3], alone)
    for i, out in enumerate(mixed[3:]):
        check_output(i, out)


def _two_turns(e: Engine, base: dict) -> list[dict]:
    """First turns, then second turns that extend them (prefix-cache hits on a cache-on engine)."""
    n = 10
    prompts = [PROMPTS[i % 3] for i in range(n)]
    first = e.generate(prompts, [constrained(i, base) for i in range(n)], return_logprob=True)
    follow = [p + o["text"] + "<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
              for p, o in zip(prompts, first)]
    second = e.generate(follow, [constrained(i + 1, base) for i in range(n)], return_logprob=True)
    for i, out in enumerate(first):
        check_output(i, out)
    for i, out in enumerate(second):
        check_output(i + 1, out)
    return first + second


@pytest.mark.parametrize("base", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_prefix_cache_on_and_off_identical(engine, engine_off, base):
    on = _two_turns(engine, base)
    off = _two_turns(engine_off, base)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    compare_outputs(on, off)
    assert sum(o["meta_info"]["cached_tokens"] for o in on) > 0
    engine.wait_idle()
    engine.check_integrity()


def test_speculation_is_exact_and_checks_drafts(engine_off):
    reference = _two_turns(engine_off, GREEDY)
    with Engine(speculative_algorithm="ngram", speculative_num_draft_tokens=4, debug_checks=True, **POOLS) as eng:
        ngram = _two_turns(eng, GREEDY)  # the real drafter: grammar-valid prefixes only
        assert [o["output_ids"] for o in ngram] == [o["output_ids"] for o in reference]
        compare_outputs(ngram, reference)
        # an oracle that proposes the reference continuation with corruptions (many grammar-invalid):
        # verification must reject every invalid draft and keep the output exact
        tok = eng.tokenizer
        ref = {tuple(tok.encode(p)): o["output_ids"] for p, o in zip(
            [PROMPTS[i % 3] for i in range(10)], reference[:10])}
        eng.scheduler.drafter = oracle = OracleDrafter(ref, num_draft=3, error_rate=0.3)
        n = 10
        got = eng.generate([PROMPTS[i % 3] for i in range(n)], [constrained(i, GREEDY) for i in range(n)],
                           return_logprob=True)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in reference[:10]]
        assert oracle.num_proposed > 0 and eng.scheduler.num_accepted_tokens > 0
        assert any(o["meta_info"].get("spec_accept_length", 1) > 1 for o in got)
        sampled = eng.generate([PROMPTS[i % 3] for i in range(n)], [constrained(i, SAMPLED) for i in range(n)])
        for i, out in enumerate(sampled):
            check_output(i, out)
        eng.wait_idle()
        eng.check_integrity()


def test_streaming(engine):
    params = {**SAMPLED, "json_schema": SCHEMA, "seed": 3}
    full = engine.generate(PROMPTS[0], params)
    chunks = list(engine.generate(PROMPTS[0], params, stream=True))
    assert len(chunks) > 2
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert_complete(full)
    check_schema(json.loads(full["text"]), SCHEMA)


# --- refused at submission -----------------------------------------------------------------------


@pytest.mark.parametrize("params, message", [
    ({"regex": "a(b"}, "regex cannot be compiled"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"regex": 5}, "regex must be a non-empty string"),
    ({"json_schema": "{nope"}, "json_schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
    ({"json_schema": {"type": "object", "enum": {1, 2}}}, "json_schema is not JSON"),
    ({"json_schema": {"type": "no-such-type"}}, "json_schema cannot be compiled"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "json_schema cannot be compiled"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf cannot be compiled"),
    ({"ebnf": 'start: "a" | ('}, "ebnf cannot be compiled"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one of json_schema, regex and ebnf"),
    ({"grammar_after": "</think>"}, "grammar_after needs a grammar"),
    ({"regex": "a", "grammar_after": ""}, "grammar_after must be a string of 1 to 64 characters"),
    ({"regex": "a", "grammar_after": "x" * 65}, "grammar_after must be a string"),
    ({"regex": "a", "grammar_after": 5}, "grammar_after must be a string"),
    ({"regex": "a", "grammar_after_open": "<think>"}, "grammar_after_open needs grammar_after"),
    ({"regex": "a", "grammar_after": "</think>", "grammar_after_open": ""}, "grammar_after_open must be a string"),
])
def test_bad_grammar_is_a_value_error(engine, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate("x", {"max_new_tokens": 4, **params})
    assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2  # still serving


def test_no_tokenizer_no_grammar(qwen3_next_dense_path):
    with Engine(qwen3_next_dense_path, **POOLS) as e:
        with pytest.raises(ValueError, match="needs a tokenizer"):
            e.generate(input_ids=[5, 6, 7], sampling_params={"regex": "[a-z]+"})


def test_padded_lm_head_ids_are_never_sampled(tmp_path, tokenizer):
    """A random model whose LM head has 64 more rows than the tokenizer has ids."""
    path = checkpoints.make_qwen3_next(tmp_path, vocab_size=tokenizer.vocab_size + 64,
                                       eos_token_id=tokenizer.eos_token_id)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    with Engine(path, **POOLS) as e:
        outs = e.generate([PROMPTS[2]] * 4, [{"temperature": 1.5, "seed": s, "max_new_tokens": 24,
                                              "regex": "[a-z ]{1,40}"} for s in range(4)])
        for out in outs:
            assert all(t < tokenizer.vocab_size or t in e.eos_token_ids for t in out["output_ids"])
            assert re.fullmatch("[a-z ]{1,40}", out["text"]), out["text"]


def test_native_generate_api():
    with BackgroundServer(create_app(None, max_total_tokens=4096, max_running_requests=4)) as srv:
        body = {"text": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 96, "json_schema": SCHEMA}}
        r = httpx.post(srv.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        check_schema(json.loads(out["text"]), SCHEMA)
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}
        bad = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"regex": "a(b"}}, timeout=60)
        assert bad.status_code == 400
        assert "regex cannot be compiled" in bad.json()["error"]["message"]


# --- the mask contract (unit) --------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, tokenizer.vocab_size + 40, eos_token_ids=[2, 0])


def _allowed(grammars: Grammars, matchers, drafts=None) -> torch.Tensor:
    mask = grammars.fill(matchers, drafts)
    return unpack_bitmask(mask.bitmask, grammars.vocab_size)


def test_eos_allowed_exactly_where_the_grammar_may_end(grammars, tokenizer):
    a = tokenizer.token_to_id("a")
    m = grammars.matcher("regex", "a{2,3}")
    seen = []
    for _ in range(3):
        row = _allowed(grammars, [m])[0]
        seen.append((bool(row[2]), bool(row[0]), m.terminated))
        assert row[a] and m.accept(a)
    row = _allowed(grammars, [m])[0]
    assert seen == [(False, False, False), (False, False, False), (True, True, False)]
    assert m.terminated and row.nonzero().flatten().tolist() == [0, 2]  # complete: EOS only
    assert not m.accept(a) and m.error  # a refused token: error state, reported


def test_ids_beyond_the_tokenizer_are_masked(grammars, tokenizer):
    m = grammars.matcher("regex", "[a-z ]*")
    row = _allowed(grammars, [None, m])
    assert row.shape == (1, tokenizer.vocab_size + 40)
    assert row[0, :tokenizer.vocab_size].any() and not row[0, tokenizer.vocab_size:].any()
    logits = torch.randn(2, grammars.vocab_size)
    free = logits[0].clone()
    apply_token_mask(logits, grammars.fill([None, m]))
    assert torch.equal(logits[0], free)  # an unconstrained row is untouched
    assert torch.isinf(logits[1, tokenizer.vocab_size:]).all()
    assert torch.equal(torch.isfinite(logits[1]), row[0])


def test_draft_rows_are_the_masks_after_each_draft(grammars, tokenizer):
    answer = tokenizer.encode('{"name": "Ann", "age": 7, "role": "user", "tags": [], "ok": true}',
                              add_special_tokens=False)
    source = grammar_source("json_schema", SCHEMA)
    m, ref = grammars.matcher("json_schema", source), grammars.matcher("json_schema", source)
    for t in answer[:3]:
        assert m.accept(t) and ref.accept(t)
    drafts = answer[3:8]
    assert m.valid_prefix(drafts) == len(drafts)
    rows = _allowed(grammars, [None, m, None], [[], drafts, []])
    assert rows.shape[0] == 1 + len(drafts)
    for j, t in enumerate(drafts):
        assert torch.equal(rows[j], _allowed(grammars, [ref])[0])
        assert ref.accept(t)
    assert torch.equal(rows[len(drafts)], _allowed(grammars, [ref])[0])
    assert torch.equal(_allowed(grammars, [m])[0], rows[0])  # filling left the matcher where it was
    # an invalid draft: the valid prefix stops there and every row still allows something
    bad = drafts[:1] + [tokenizer.token_to_id("}")] + drafts[2:]  # '{"name' '":' then '}': refused
    assert m.valid_prefix(bad) == 1
    rows = _allowed(grammars, [m], [bad])
    assert all(r.any() for r in rows)
    for t in drafts:
        assert m.accept(t)
    m.rollback(len(drafts))
    assert torch.equal(_allowed(grammars, [m])[0], rows[0])


def test_pool_and_calling_thread_fill_alike(tokenizer):
    """The two fill paths (llguidance's pool; one call per matcher on this thread) give the same rows."""
    pool = Grammars(tokenizer, tokenizer.vocab_size, eos_token_ids=[2], num_threads=1, min_parallel=1)
    here = Grammars(tokenizer, tokenizer.vocab_size, eos_token_ids=[2], num_threads=0)
    answer = tokenizer.encode('{"name": "Bo", "age": 31, "role": "admin", "tags": ["x"], "ok": false}',
                              add_special_tokens=False)
    source = grammar_source("json_schema", SCHEMA)
    masks = []
    for g in (pool, here):
        ms = [g.matcher("json_schema", source) for _ in range(3)]
        for k, m in enumerate(ms):
            for t in answer[:4 * k]:
                assert m.accept(t)
        drafts = [answer[0:3], [], answer[8:10] + [tokenizer.token_to_id("{")] + answer[11:12]]
        masks.append((_allowed(g, ms + [None]), _allowed(g, [None] + ms, [[]] + drafts)))
    assert torch.equal(masks[0][0], masks[1][0]) and torch.equal(masks[0][1], masks[1][1])
    assert all(r.any() for r in masks[1][1])


def test_compile_cache(tokenizer):
    g = Grammars(tokenizer, tokenizer.vocab_size, eos_token_ids=[2], cache_size=2)
    a1, a2 = g.matcher("regex", "[0-9]+"), g.matcher("regex", "[0-9]+")
    assert g.num_cached == 1
    one = tokenizer.token_to_id("1")
    assert a1.accept(one) and a1.valid_prefix([one]) == 1 and a2.valid_prefix([one, one]) == 2  # independent
    g.matcher("regex", "[a-z]+")
    g.matcher("ebnf", 'root ::= "x"')
    assert g.num_cached == 2  # least recently used dropped
    with pytest.raises(ValueError):
        g.matcher("regex", "(")
    assert g.num_cached == 2  # failures are not cached


@pytest.mark.parametrize("kind, source, good, bad", [
    ("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}),
     'Let me think. {"ok": 1}? </think>\n\n{"ok": true}', 'hmm </think>{"ok": 1}'),
    ("regex", "a/b+", "why </think> a/bb", "t</think>ab"),
    ("ebnf", 'root ::= "yes" | "no"', "</think>\nyes", "w</think>maybe"),
    ("ebnf", 'start: "x" y\ny: "z"', "q q</think>xz", "q</think>zx"),
])
def test_a_grammar_after_a_marker_starts_there(grammars, tokenizer, kind, source, good, bad):
    """``grammar_after`` (a reasoning model's ``</think>``): any text up to the marker's first occurrence
    (a thought that quotes the answer's shape included), whitespace, then the grammar, of every kind; an
    answer the grammar refuses after the marker is refused. Without the marker the grammar starts at once."""
    def follows(text: str, after: str | None) -> bool:
        matcher = grammars.matcher(kind, source, after=after)
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
    assert follows(good, "</think>") and not follows(bad, "</think>")
    assert not follows(good, None) and follows(good.split("</think>")[1].strip(), None)


@pytest.mark.parametrize("kind, source, good, bad", [
    ("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                "additionalProperties": False}),
     ['{"ok": true}', '<think>Is it {"ok": 1}? No.</think>\n\n{"ok": false}', '\n<think>\nhm\n</think>{"ok": true}'],
     ['{"ok": 1}', 'hm </think>{"ok": true}', '<think>x</think>{"ok": 1}', '<think>a</think><think>b</think>{"ok": true}']),
    ("regex", "a/b+", ["a/bb", "<think>a/b?</think> a/b"], ["<think>a/b", "think</think>a/b", "<think>x</think>ab"]),
    ("ebnf", 'root ::= "yes" | "no"', ["no", " <think></think>yes"], ["maybe", "<think>q</think>\nmaybe"]),
])
def test_a_grammar_after_an_optional_block_starts_at_once_or_after_it(grammars, tokenizer, kind, source, good, bad):
    """``grammar_after`` with ``grammar_after_open`` (a model that opens its own ``<think>``): the output is
    the grammar's at once, or whitespace, one block from the opener to the first end marker, whitespace,
    and then the grammar's; free text not opened by the opener, or a second block, is refused."""
    def follows(text: str) -> bool:
        matcher = grammars.matcher(kind, source, after="</think>", opener="<think>")
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False) + [2])  # 2: EOS
    assert [follows(t) for t in good] == [True] * len(good)
    assert [follows(t) for t in bad] == [False] * len(bad)


@pytest.mark.parametrize("opener", [None, "<think>"])
def test_whitespace_between_a_think_block_and_the_grammar_is_bounded(grammars, tokenizer, opener):
    """At most ``MAX_SPACE_AFTER`` whitespace characters between the end marker and the grammar's answer
    (and before an optional block's opener): a model must not loop on whitespace there, never answering."""
    from hyla.engine.grammar import MAX_SPACE_AFTER

    def follows(text: str) -> bool:
        matcher = grammars.matcher("regex", "yes", after="</think>", opener=opener)
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False) + [2])
    block = "<think>hm</think>"
    assert follows(block + "\n" * MAX_SPACE_AFTER + "yes") and not follows(block + "\n" * (MAX_SPACE_AFTER + 1) + "yes")
    if opener is not None:
        assert follows(" " * MAX_SPACE_AFTER + block + "yes") and not follows(" " * (MAX_SPACE_AFTER + 1) + block + "yes")


def test_an_engine_request_thinks_then_answers_in_its_grammar(engine, tokenizer):
    """Through the engine: with ``grammar_after`` the output is free up to the marker, then the grammar's.
    The tiny model is made to write the marker (one token) first by ``logit_bias``; the grammar then
    forbids it, and the answer is one of the grammar's. Without ``grammar_after`` the marker is refused
    from the first token."""
    marker, text = 726, tokenizer.decode([726])
    params = {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)", "logit_bias": {marker: 100}}
    after = engine.generate(input_ids=[5, 6, 7], sampling_params={**params, "grammar_after": text})
    assert re.fullmatch(re.escape(text) + r"\s*(yes|no)", after["text"]), after["text"]
    assert after["meta_info"]["finish_reason"]["type"] == "stop"
    plain = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert re.fullmatch("yes|no", plain["text"]), plain["text"]
