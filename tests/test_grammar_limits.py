"""Structured outputs at their limits: a grammar the engine cannot enforce as written is a
``ValueError`` at submission (a 400 from the server), never a crash, a mid-request abort or an
output that breaks it.

* Deep grammars: llguidance's compilers recurse once per ``$ref`` link / Lark rule of a chain; on an
  8 MB stack a 954-link JSON schema or a 2,748-rule Lark chain killed the process (SIGSEGV). They
  compile on a 1 GiB-stack thread now (``grammar.COMPILE_STACK_BYTES``), checked in a subprocess.
* Parser limits: a top-level alternation of thousands of branches failed on the first token, a
  500 mid-request; it is refused when compiled (the probe: the mask after one token).
* Unenforceable: integer bounds llguidance saturates or rounds (written in an integer's schema or
  reached from it through a local ``$ref``), an empty language, a self-referential root
  (``{"$ref": "#"}``), a grammar that only matches the empty output.
* GBNF conversion: linear in the rules (llguidance's converter is quadratic in a chain of them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hyla import Engine
from hyla.engine import grammar as grammar_module
from hyla.engine.engine import DEFAULT_MODEL_DIR
from hyla.engine.grammar import MAX_GRAMMAR_CHARS, Grammars, ebnf_to_lark, grammar_source
from hyla.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
POOLS = dict(max_total_tokens=4096, max_state_slots=16, max_running_requests=4, chunked_prefill_size=256)
BIG = {"minimum": 2**53 + 1, "maximum": 2**53 + 9}  # llguidance let 2**53 through


def ref_chain(n: int) -> dict:
    """``d0.x -> d1.x -> ... -> dn``: a JSON schema ``n`` ``$ref`` links deep."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}?\n' for i in range(n)) + f'r{n}: "z"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}?\n' for i in range(n)) + f'r{n} ::= "z"\n'


@pytest.fixture(scope="module")
def engine():
    with Engine(**POOLS) as e:
        yield e


@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    return Grammars(tok, tok.vocab_size, eos_token_ids=[tok.eos_token_id], num_threads=0)


# --- deep grammars: no crash ---------------------------------------------------------------------


def test_deep_chains_compile_without_crashing_the_process():
    """Past the 8 MB-stack crash points (954 links, 2,748 Lark rules), in a subprocess so that a
    regression fails this test instead of killing the run; the main thread's stack size is left
    as it was."""
    code = textwrap.dedent("""
        import threading
        from hyla.engine.engine import DEFAULT_MODEL_DIR
        from hyla.engine.grammar import Grammars, grammar_source
        from hyla.tokenizer import Tokenizer
        from test_grammar_limits import ref_chain, lark_chain, gbnf_chain
        tok = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
        g = Grammars(tok, tok.vocab_size, [tok.eos_token_id], num_threads=0)
        g.matcher("json_schema", grammar_source("json_schema", ref_chain(1500)))
        g.matcher("ebnf", lark_chain(4000))
        g.matcher("ebnf", gbnf_chain(3500))
        try:
            g.matcher("json_schema", grammar_source("json_schema", ref_chain(16000)))
        except ValueError as e:
            print("refused:", e)
        print("stack size", threading.stack_size())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
    assert "refused: json_schema cannot be compiled: schema too large" in run.stdout, run.stdout
    assert "stack size 0" in run.stdout, run.stdout


def test_compile_errors_cross_the_compile_thread(grammars):
    before = threading.stack_size()
    with pytest.raises(ValueError, match="regex cannot be compiled"):
        grammars.matcher("regex", "a(b")
    assert threading.stack_size() == before
    assert grammar_module.COMPILE_STACK_BYTES >= 1 << 30


@pytest.mark.parametrize("kind", ["regex", "ebnf"])
def test_grammar_size_bound(grammars, kind):
    source = "a" * (MAX_GRAMMAR_CHARS + 1) if kind == "regex" else 'root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"'
    with pytest.raises(ValueError, match=rf"{kind} cannot be compiled: grammar too large \(\d+ characters; "
                                         rf"at most {MAX_GRAMMAR_CHARS}\)"):
        grammars.matcher(kind, source)


def test_deeply_nested_schema_object_is_a_value_error():
    deep: dict = {"type": "integer"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="json_schema is nested too deeply"):
        grammar_source("json_schema", deep)
    with pytest.raises(ValueError, match="json_schema is nested too deeply"):
        grammar_source("json_schema", '{"items":' * 5000 + "{}" + "}" * 5000)


# --- refused at submission, through the engine -------------------------------------------------


def _anyof_objects(n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"],
                       "additionalProperties": False} for i in range(n)]}


def _nested_id(inner: dict, outer: dict) -> dict:
    """A property with an ``$id`` whose ``$ref`` ``#/$defs/x`` names its own ``$defs`` entry (``inner``;
    llguidance resolves it there), not the root's (``outer``)."""
    n = {"$id": "http://example.com/n", "type": "integer", "$ref": "#/$defs/x", "$defs": {"x": inner}}
    return {"type": "object", "properties": {"n": n}, "required": ["n"], "$defs": {"x": outer}}


@pytest.mark.parametrize("params, message", [
    # llguidance keeps integer bounds as 64-bit floats, saturated to int64: 2**63 - 1 was generated
    ({"json_schema": {"type": "integer", "minimum": 10**30, "maximum": 10**30 + 5}},
     "the integer bound minimum 1000000000000000000000000000000 at # cannot be enforced exactly"),
    ({"json_schema": {"type": "object", "properties": {"n": {"type": ["integer", "null"], "minimum": 2**53 + 1}}}},
     "the integer bound minimum 9007199254740993 at #/properties/n cannot be enforced exactly"),
    ({"json_schema": {"type": "integer", "exclusiveMinimum": 2**60}}, "exclusiveMinimum 1152921504606846976"),
    ({"json_schema": {"type": "integer", "maximum": -(10**30)}}, "maximum -1000000000000000000000000000000"),
    # a bound in a subschema of an integer's (allOf / anyOf / ...), or beside one in an allOf: 2**53 was generated
    ({"json_schema": {"type": "integer", "allOf": [{"minimum": 2**53 + 1, "maximum": 2**53 + 9}]}},
     "the integer bound minimum 9007199254740993 at #/allOf/0 cannot be enforced exactly"),
    ({"json_schema": {"allOf": [{"type": "integer"}, {"anyOf": [{"maximum": 5}, {"minimum": 10**30}]}]}},
     "the integer bound minimum 1000000000000000000000000000000 at #/allOf/1/anyOf/1"),
    # ... or in a subschema a local $ref of an integer's points at (no type of its own): 2**53 was generated
    ({"json_schema": {"type": "integer", "allOf": [{"$ref": "#/$defs/big"}], "$defs": {"big": BIG}}},
     "the integer bound minimum 9007199254740993 at #/$defs/big cannot be enforced exactly"),
    ({"json_schema": {"type": "integer", "$ref": "#/definitions/big", "definitions": {"big": BIG}}},
     "the integer bound minimum 9007199254740993 at #/definitions/big cannot be enforced exactly"),
    ({"json_schema": {"type": ["integer", "null"], "$ref": "#/$defs/a",  # a chain, and an escaped name
                      "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b~1c~0"}]}, "b/c~": {"maximum": -(10**30)}}}},
     "the integer bound maximum -1000000000000000000000000000000 at #/$defs/b~1c~0 cannot"),
    ({"json_schema": {"minimum": 2**60 + 1, "anyOf": [{"type": "string"}, {"type": "integer", "$ref": "#"}]}},
     "the integer bound minimum 1152921504606846977 at # cannot be enforced exactly"),  # the root, a cycle
    ({"json_schema": {"type": "integer", "$ref": "#/$defs/a%20b", "$defs": {"a b": BIG}}},  # percent-encoded
     "the integer bound minimum 9007199254740993 at #/$defs/a b cannot be enforced exactly"),
    ({"json_schema": _nested_id(inner=BIG, outer={"minimum": 3})},  # resolved in the schema with the $id
     "the integer bound minimum 9007199254740993 at #/properties/n/$defs/x cannot be enforced exactly"),
    # ... or beside a local $ref whose chain reaches a schema typed integer
    ({"json_schema": {"$ref": "#/$defs/int", "minimum": 2**53 + 1, "$defs": {"int": {"type": "integer"}}}},
     "the integer bound minimum 9007199254740993 at # cannot be enforced exactly"),
    ({"json_schema": {"allOf": [{"$ref": "#/$defs/a"}], "maximum": -(10**30),
                      "$defs": {"a": {"$ref": "#/$defs/int"}, "int": {"type": ["integer", "null"]}}}},
     "the integer bound maximum -1000000000000000000000000000000 at # cannot be enforced exactly"),
    ({"json_schema": {"$ref": "#"}}, "json_schema cannot be compiled: it matches no output"),
    ({"regex": r"[^\s\S]"}, "regex cannot be compiled: it matches no output"),
    ({"ebnf": "root ::= "}, "ebnf cannot be compiled: it matches only the empty output"),
    ({"regex": "()"}, "regex cannot be compiled: it matches only the empty output"),
    # a row of more than MAX_ITEMS_IN_ROW Earley items after the first token (was a 500 mid-request)
    ({"ebnf": "root ::= " + " | ".join(f'"t{i}"' for i in range(2500))},
     "ebnf cannot be compiled: too complex (Parser Error: Current row has 2501 items; max is 2000"),
    ({"json_schema": _anyof_objects(2500)},
     "json_schema cannot be compiled: too complex (Parser Error: Current row has 2500 items; max is 2000"),
])
def test_unenforceable_grammar_is_a_value_error(engine, params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate("x", {"max_new_tokens": 4, **params})
    assert engine.generate("x", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2  # still serving


@pytest.mark.parametrize("schema, check", [
    ({"type": "integer", "maximum": 10**30}, lambda v: v <= 10**30),  # int64 tightens it: still valid
    ({"type": "integer", "minimum": -5, "maximum": 2**63 - 1}, lambda v: v >= -5),  # int64's own maximum
    ({"type": "integer", "minimum": 2**62, "maximum": 2**62 + 2**12}, lambda v: 2**62 <= v <= 2**62 + 2**12),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, lambda v: isinstance(v, dict)),  # recursion below the root
    # a number's bounds are not an integer's, nor are its properties' those of an integer beside it
    ({"type": "number", "allOf": [{"minimum": 2**53 + 1}]}, lambda v: v >= 2**53 + 1),
    ({"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": {"type": "number", "minimum": 2**53 + 1}}}]},
     lambda v: isinstance(v, (int, dict))),
    # a local $ref of an integer's to in-range bounds; the target's properties are not the integer's
    ({"type": "integer", "$ref": "#/$defs/small", "$defs": {"small": {"minimum": 3, "maximum": 7}}},
     lambda v: 3 <= v <= 7),
    ({"type": "integer", "allOf": [{"$ref": "#/$defs/a"}],
      "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"maximum": 10**30}}},
     lambda v: v <= 10**30),
    ({"type": ["integer", "object"], "$ref": "#/$defs/o",
      "$defs": {"o": {"properties": {"x": {"type": "number", "minimum": 2**53 + 1}}}}},
     lambda v: isinstance(v, (int, dict))),
    (_nested_id(inner={"minimum": 3, "maximum": 7}, outer=BIG), lambda v: 3 <= v["n"] <= 7),  # not the root's $defs
    # beside a $ref to a number (not an integer), or to an integer with bounds in range
    ({"$ref": "#/$defs/num", "minimum": 2**53 + 1, "$defs": {"num": {"type": "number"}}}, lambda v: v >= 2**53 + 1),
    ({"$ref": "#/$defs/int", "minimum": 3, "maximum": 7, "$defs": {"int": {"type": "integer"}}}, lambda v: 3 <= v <= 7),
])
def test_enforceable_bounds_still_compile(engine, schema, check):
    out = engine.generate("Here is a number:", {"temperature": 0, "max_new_tokens": 40, "json_schema": schema})
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert check(json.loads(out["text"])), out["text"]


def test_integer_bounds_follow_a_long_ref_chain_without_recursion(grammars):
    """The check walks a chain of local ``$ref`` links iteratively: 20,000 links (far past Python's
    recursion limit) to an unenforceable bound are refused by the check, before llguidance."""
    n = 20_000
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"exclusiveMinimum": 2**60}
    source = grammar_source("json_schema", {"type": "integer", "$ref": "#/$defs/d0", "$defs": defs})
    with pytest.raises(ValueError, match=re.escape(f"exclusiveMinimum 1152921504606846976 at #/$defs/d{n} cannot")):
        grammars.matcher("json_schema", source)
    # the other way: the type at the chain's end, the bound at its start (each link's chain walked once)
    defs[f"d{n}"] = {"type": "integer"}
    source = grammar_source("json_schema", {"$ref": "#/$defs/d0", "minimum": 2**60 + 1, "$defs": defs})
    with pytest.raises(ValueError, match=re.escape("minimum 1152921504606846977 at # cannot")):
        grammars.matcher("json_schema", source)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "$ref": "#"},
    {"type": "integer", "$ref": "#/$defs/a",
     "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
    {"type": "integer", "minimum": 1, "$ref": "#/$defs/a", "$defs": {"a": {"maximum": 9, "anyOf": [{"$ref": "#"}]}}},
])
def test_cyclic_refs_from_an_integer_terminate(grammars, schema):
    """A ``$ref`` cycle reached from an integer (``#`` itself, mutual references) ends the check:
    the schema compiles, or llguidance refuses it with a ``ValueError``, no hang or RecursionError."""
    try:
        grammars.matcher("json_schema", grammar_source("json_schema", schema))
    except ValueError as e:
        assert str(e).startswith("json_schema cannot be compiled: "), e
        assert "integer bound" not in str(e), e


def test_a_ref_cycle_still_finds_an_unenforceable_bound(grammars):
    schema = {"type": "integer", "$ref": "#/$defs/a",
              "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a", "minimum": 2**60 + 1}}}
    with pytest.raises(ValueError, match=re.escape("the integer bound minimum 1152921504606846977 at #/$defs/b")):
        grammars.matcher("json_schema", grammar_source("json_schema", schema))


def test_a_long_right_recursive_list_meets_the_row_limit_with_a_one_line_error(grammars):
    """A right-recursive rule adds two Earley items a repetition: llguidance's row limit
    (``MAX_ITEMS_IN_ROW``) ends it at 1,000 repetitions, with one line (no parser state dump)."""
    tok = grammars.tokenizer
    m = grammars.matcher("ebnf", 'root ::= "[" items "]"\nitems ::= "a" ("," items)?')
    a, comma = tok.tokenize_str("a")[0], tok.tokenize_str(",")[0]
    assert m.accept(tok.tokenize_str("[")[0])
    reps = 0
    while reps < 1100 and m.accept(a) and m.accept(comma):
        reps += 1
    assert 900 < reps < 1100, reps
    assert m.error.startswith("Parser Error: Current row has") and "\n" not in m.error, m.error


# --- GBNF conversion -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe"',
    'root ::= objVal | my-rule\n# a comment\nobjVal ::= "{" ws "}"\nmy-rule ::= [a-z]+ ws ("x" | root)\n'
    'ws ::= ([ \\t\\n] ws)?\n',
    'root ::= a b c\na ::= "x"{2,5}\nb ::= c | "y"\nc ::= [^"\\\\] | "\\u00e9"\n',
    'root ::= x\nx ::= y\ny ::= x | "q"\n',
    'root ::= "a" (("b" | "c")* | "d"+) .\n',
    gbnf_chain(40),
    'start: "[" NUM ("," NUM){0,3} "]"\nNUM: /[0-9]{1,3}/',  # Lark: as is
])
def test_gbnf_conversion_is_llguidances(text):
    from llguidance.gbnf_to_lark import any_to_lark

    assert ebnf_to_lark(text) == any_to_lark(text)


@pytest.mark.parametrize("text, message", [
    ("root ::= undefined_rule", "Rule 'undefined_rule' not found"),
    ('foo ::= "a"', "No 'root' rule found"),
    ('root ::= "a\n', "Unexpected end of input"),
    ("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, "maximum recursion depth exceeded"),
])
def test_gbnf_conversion_errors(text, message):
    with pytest.raises(ValueError, match=re.escape("Failed to convert the grammar from GBNF to Lark: " + message)):
        ebnf_to_lark(text)


def test_gbnf_conversion_is_linear_in_a_chain_of_rules():
    """llguidance's converter re-scans every rule once per link: ~2.3 s for 1,000 rules, ~150 s for
    8,000, holding the GIL. Here 8,000 take well under a second (a generous bound for a busy box)."""
    text = gbnf_chain(8000)
    t0 = time.perf_counter()
    lark = ebnf_to_lark(text)
    assert time.perf_counter() - t0 < 8
    assert "R7999: \"a\" R8000?" in lark and lark.count("\n") > 8000
