"""Text <-> token ids for the engine, the server and scripts.

    from hyla.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained("path/to/model")
    ids = tok.encode("Hello")                       # and tok.decode(ids)
    chat = tok.encode_chat(messages)                # ids + the token position at each message's end
    detok = tok.detokenizer(prompt_ids=chat.ids)    # streaming decode: detok.step(id) -> str, detok.flush()
    text, data = tok.token_text(ids[0])             # a token as logprobs show it

Files, one idea each: ``tokenizer.py`` (``Tokenizer``: loading, encode/decode, special ids, chat
encoding), ``chat_template.py`` (the jinja2 sandbox), ``detokenizer.py`` (incremental decoding),
``token_text.py`` (a token's display text and bytes), ``tiktoken_bpe.py`` (a tiktoken file, Kimi's,
as a BPE backend).
"""

from hyla.tokenizer.chat_template import ChatTemplate, render_chat_template
from hyla.tokenizer.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from hyla.tokenizer.token_text import TokenText
from hyla.tokenizer.tokenizer import ChatEncoding, Tokenizer

__all__ = ["ChatEncoding", "ChatTemplate", "IncrementalDetokenizer", "REPLACEMENT_CHAR", "TokenText", "Tokenizer",
           "render_chat_template"]
