"""A tiktoken file (Kimi's ``tiktoken.model``) as hyla's tokenizer, against ``tiktoken`` itself: a BPE
trained here on a small mixed corpus, written as a tiktoken file with a Kimi ``tokenizer_config.json``;
hyla's ids must be tiktoken's for any text (Han, words with case and contractions, numbers, emoji,
whitespace runs, special tokens written in the text), and decode back to the text."""

from __future__ import annotations

import base64
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from hyla.tokenizer import Tokenizer
from hyla.tokenizer.tiktoken_bpe import TIKTOKEN_FILE

tiktoken = pytest.importorskip("tiktoken")  # (a dev dependency: the oracle)

CORPUS = """The river runs to the sea; it's been running since the hills were young. I'm sure they'll
say we'd LOVE to see THE RIVER'S end. def main(argv):\n    return 42  # TODO: 1234567 tokens
今天天气很好，我们去河边散步吧。河流奔向大海。  Ünïcödé café naïve résumé — “quotes” and ‘more’.
\t\tindented\r\n\r\nwindows lines   trailing spaces   \n emoji 🙂🙂 👩‍💻 and numbers 3.14159, 2026-12-06.
 今天 河流 今天 河流 的河 riverRiver camelCase HTTPServer x今天 THEriver 河river 今天 河流"""
# Kimi's TikTokenTokenizer.pat_str (tokenization_kimi.py), the oracle's own copy
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NAMED = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>", 5: "<|im_assistant|>", 7: "<|im_system|>",
         8: "<|im_middle|>", 10: "<|tool_call_begin|>"}  # offsets from the base vocabulary (Kimi's names)


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE's ranks: the 256 bytes, then the most frequent adjacent pair's concatenation, again
    and again, within space-separated words."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in text.replace(" ", "\0 ").split("\0")]
    for _ in range(merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:]))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    return ranks


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> tuple[Path, object]:
    """A Kimi-style model directory with a trained tiktoken file, and the ``tiktoken.Encoding`` that Kimi's
    remote code builds from it."""
    path = tmp_path_factory.mktemp("kimi_tok")
    ranks = train_ranks(CORPUS * 3, 400)
    for token in (b"qqq", b" qqq", "河流河".encode()):  # tokens no merge reaches (tiktoken takes a whole pre-token)
        ranks[token] = len(ranks)
    n = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    (path / TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    decoder = {str(n + k): {"content": v, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                            "single_word": False} for k, v in NAMED.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": decoder, "chat_template": "{% if tools %}<|im_system|>{{ tools | tojson }}<|im_end|>"
        "{% endif %}{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"}))
    specials = {NAMED.get(i - n, f"<|reserved_token_{i}|>"): i for i in range(n, n + 258)}
    encoding = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                 special_tokens=specials)
    return path, encoding


def _random_text(rng: random.Random) -> str:
    pieces = ["the", "The", "THE", "river", "'s", "'LL", "'d", " ", "  ", "\n", "\r\n", "\t", "今天", "河流", "。",
              "，", "123", "4567", "3.14", "é", "Ü", "🙂", "👩‍💻", "—", "(", ")", "{}", "<|im_end|>", "[BOS]",
              "<|reserved_token_300|>", "<|im_", "|>", "x", "Q", "'", "qqq", " qqq", "河流河", "River", "HTTP",
              "\u0301", "\u00a0", "\u3000", "a\u0301"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))


def test_ids_are_tiktokens_for_any_text(kimi_dir):
    path, encoding = kimi_dir
    tok = Tokenizer.from_pretrained(path)
    rng = random.Random(0)
    texts = CORPUS.splitlines() + [CORPUS] + [_random_text(rng) for _ in range(1500)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == encoding.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_follow_the_base_vocabulary(kimi_dir):
    """Named ones from ``added_tokens_decoder``, the others ``<|reserved_token_{id}|>``; the chat template
    and the end-of-sequence token work as for a tokenizer.json."""
    path, encoding = kimi_dir
    tok = Tokenizer.from_pretrained(path)
    n = encoding.n_vocab - 258
    assert tok.vocab_size == encoding.n_vocab
    assert tok.token_to_id("<|im_end|>") == n + 3 and tok.token_to_id(f"<|reserved_token_{n + 2}|>") == n + 2
    assert (tok.bos_token_id, tok.eos_token_id) == (n, n + 1)
    assert tok.decode(tok.encode("hi<|im_end|>", add_special_tokens=False)) == "hi"  # skipped: special
    chat = tok.encode_chat([{"role": "user", "content": "今天 river's"}])
    assert chat.ids == encoding.encode("<|im_user|>今天 river's<|im_end|><|im_assistant|>", allowed_special="all")


def test_the_engine_loads_a_tiktoken_tokenizer(kimi_dir):
    from hyla.engine.engine import _load_tokenizer
    tok = _load_tokenizer(kimi_dir[0])
    assert tok is not None and tok.encode("河流", add_special_tokens=False) == kimi_dir[1].encode("河流")


def test_bad_tiktoken_directories_are_value_errors(tmp_path, kimi_dir):
    path = kimi_dir[0]
    good_file = (path / TIKTOKEN_FILE).read_text()
    config = json.loads((path / "tokenizer_config.json").read_text())

    def attempt(file_text: str, cfg: dict, match: str) -> None:
        (tmp_path / TIKTOKEN_FILE).write_text(file_text)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            Tokenizer.from_pretrained(tmp_path)

    attempt(good_file, {**config, "tokenizer_class": "OtherTikToken"}, "not known")
    attempt(good_file, {k: v for k, v in config.items() if k != "tokenizer_class"}, "not known")
    attempt(good_file + "!!! 9\n", config, "not a tiktoken line")
    attempt(good_file.replace(" 300\n", " 9999\n"), config, "ranks must be")
    attempt("\n".join(good_file.splitlines()[1:]), config, "ranks must be")
    first_line = good_file.splitlines()[0]
    attempt(good_file.replace(first_line + "\n", "") + first_line.split()[0] + "\n", config, "not a tiktoken line")
    one_byte_less = good_file.replace(first_line, base64.b64encode(b"\xff\xfe\xfd").decode() + " 0", 1)
    attempt(one_byte_less, config, "single bytes are not tokens")
    n = len(good_file.splitlines())
    attempt(good_file, {**config, "added_tokens_decoder": {str(n + 300): {"content": "x"}}}, "not one of")
    attempt(good_file, {**config, "added_tokens_decoder": {str(n): {"content": "[BOS]"}, str(n + 1): {
        "content": "[BOS]"}}}, "listed twice")


def test_tools_reach_the_template_with_their_keys_sorted(kimi_dir):
    """As Kimi's remote ``apply_chat_template`` renders them (``deep_sort_dict``): the keys of every object
    sorted, lists in their order; the request's tools are not modified."""
    tok = Tokenizer.from_pretrained(kimi_dir[0])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"enum": ["y", "x"]}}}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    rendered = json.loads(text[len("<|im_system|>"):text.index("<|im_end|>")])
    assert list(rendered[0]) == ["function", "type"] and list(rendered[0]["function"]) == ["name", "parameters"]
    assert list(rendered[0]["function"]["parameters"]["properties"]) == ["alpha", "zeta"]
    assert rendered[0]["function"]["parameters"]["properties"]["alpha"]["enum"] == ["y", "x"]
    assert list(tools[0]) == ["type", "function"]
    unsorted = Tokenizer(tok.backend, chat_template=tok.chat_template).apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools)  # (a tokenizer.json's: the request's order)
    assert list(json.loads(unsorted[len("<|im_system|>"):unsorted.index("<|im_end|>")])[0]) == ["type", "function"]
