"""Teach the built-in default model to copy from its context (an in-context copy fine-tune), offline, on CPU.

    .venv/bin/python scripts/train_copy.py                                     # the committed model
    .venv/bin/python scripts/train_copy.py --induction-steps 3 --mixed-steps 3 --model-dir /tmp/copy   # smoke run (a copy!)

Real language models copy: asked to rewrite, quote or extract from a long prompt, they reproduce
spans of it, which is what n-gram speculative decoding drafts from (``speculative_algorithm="ngram"``,
``benchmarks/speculative.py``'s *grounded* workload). The default model as
``train_default_model.py`` leaves it does not: it saw 1.5M tokens, too few for the attention layers
to learn induction (attend to the token after an earlier occurrence of the current one), and its
greedy output shares no 4-gram with a passage it is asked to repeat. This script fine-tunes it
(every weight, transformers' ``Qwen3NextForCausalLM``, bf16 autocast; seeded, ``--threads`` CPU
threads) in two stages:

1. **Induction** (``induction_steps``): windows of natural-text spans (``span_min``–``span_max``
   tokens of the ShareGPT conversations, chat markup included) each repeated ``repeats_min``–
   ``repeats_max`` times, with the loss on the repeats only: the first occurrence is unpredictable
   context, so nothing pulls the model toward its language-model guess there. The copy loss falls
   abruptly once induction forms (a few hundred steps here).
2. **Mixed** (``mixed_steps``): each batch ``lm_windows`` windows of plain chat (full loss, as the
   base training: the language model comes back), ``chat_copy_windows`` chat exchanges in which the
   user asks for a passage back (one of several phrasings) and the assistant repeats it (loss on the
   reply), and repeated spans for the rest.

Held out of every stage: the conversations ``benchmarks/speculative.py`` takes its passages from,
and the base script's evaluation windows. Measured before and after (printed and written to the model
card's "Copying from the context" section): the held-out loss of the base script's evaluation windows,
the next-token accuracy on held-out spans' repeat vs their first occurrence (``span_probes`` spans of
100 tokens), and the share of output 4-grams found in the passage when the model is asked to repeat
each benchmark passage (greedy; the benchmark's ``copy_shares`` also counts 4-grams starting in the
prompt). The model's tensors are replaced in ``model.safetensors`` (bf16, names unchanged); an MTP
head (``mtp.*``) is dropped with its config key and card section, because it was trained on the old
model: run ``train_mtp_head.py`` afterwards. The card's sample exchanges are regenerated.

Run it after ``train_default_model.py`` and before ``train_mtp_head.py``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import train_default_model as base  # noqa: E402  (its data pipeline: filters, template, packing)
from hyla.tokenizer import ChatTemplate, Tokenizer  # noqa: E402

CARD_HEADING = "## Copying from the context"
MTP_HEADING = "## MTP head (speculative decoding)"
SAMPLES_HEADING = "## Sample exchanges"
IGNORE = -100

# How users ask for a passage back; ``{p}`` is the passage. The first is the benchmark's phrasing.
ASKS = [
    "Repeat the following text exactly:\n\n{p}",
    "Copy this text word for word:\n\n{p}",
    "Please repeat this back to me:\n\n{p}",
    "{p}\n\nRepeat the text above exactly.",
    "Here is a passage:\n\n{p}\n\nWrite it out again, unchanged.",
    "Quote the following verbatim:\n\n{p}",
]


@dataclass(frozen=True)
class CopyConfig:
    """Every setting of the committed fine-tune (the defaults are what produced it)."""

    model_dir: str = str(REPO_ROOT / "hyla" / "assets" / "default-model")
    seed: int = 0
    threads: int = 2
    seq_len: int = 512
    batch_size: int = 4
    induction_steps: int = 600
    mixed_steps: int = 900
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    grad_clip: float = 1.0
    span_min: int = 12
    span_max: int = 60
    repeats_min: int = 2
    repeats_max: int = 4
    lm_windows: int = 1  # of batch_size, mixed stage
    chat_copy_windows: int = 2  # of batch_size, mixed stage
    passage_min_chars: int = 150
    passage_max_chars: int = 900
    benchmark_passages: int = 8
    probe_new_tokens: int = 64
    span_probes: int = 8  # held-out 100-token spans, each repeated once, whose next-token accuracy is measured
    eval_batches: int = 0  # held-out loss over this many batches of evaluation windows; 0: all (as committed)
    eval_batch_size: int = 4  # evaluation windows (of the base script's seq_len) per held-out-loss batch

    def __post_init__(self):
        for name in ("span_probes", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# --- data ------------------------------------------------------------------------------------


class CopyData:
    """The fine-tune's training windows: ``(ids [seq_len], labels [seq_len])`` with ``IGNORE``
    where no loss is taken (a label at ``t`` is the target of position ``t - 1``, as transformers'
    ``labels``)."""

    def __init__(self, cfg: CopyConfig, tokenizer: Tokenizer, train_cfg: base.TrainConfig, held_out: set[str]):
        self.cfg, self.tok = cfg, tokenizer
        self.rng = random.Random(cfg.seed)
        self.template = ChatTemplate(tokenizer.chat_template)
        conversations = base.load_conversations(train_cfg)
        num_eval = train_cfg.eval_windows * train_cfg.seq_len
        stream, num_used = base.token_stream(conversations, tokenizer, num_eval)
        self.eval_windows = stream[:num_eval].view(-1, train_cfg.seq_len)  # the base script's held-out windows
        conversations = [c for c in conversations[num_used:] if not any(m["content"] in held_out for m in c)]
        stream, _ = base.token_stream(conversations, tokenizer, cfg.mixed_steps * cfg.lm_windows * cfg.seq_len)
        self.train_tokens = stream.tolist()
        self.lm_windows = stream[: len(stream) // cfg.seq_len * cfg.seq_len].view(-1, cfg.seq_len)
        self.passages = [m["content"] for c in conversations for m in c if m["role"] == "assistant"
                         and cfg.passage_min_chars <= len(m["content"]) <= cfg.passage_max_chars]
        self.num_lm = self.num_chat = 0

    def spans(self) -> tuple[list[int], list[int]]:
        """A window of natural-text spans, each repeated; labels on the repeats only."""
        cfg, ids, labels = self.cfg, [], []
        while len(ids) < cfg.seq_len:
            n = self.rng.randint(cfg.span_min, cfg.span_max)
            start = self.rng.randrange(len(self.train_tokens) - n)
            span = self.train_tokens[start:start + n]
            reps = self.rng.randint(cfg.repeats_min, cfg.repeats_max)
            ids += span * reps
            labels += [IGNORE] * n + span * (reps - 1)
        return ids[:cfg.seq_len], labels[:cfg.seq_len]

    def chat_copy(self) -> tuple[list[int], list[int]]:
        """A chat exchange in which the assistant repeats a passage; labels on the reply."""
        i = self.num_chat
        self.num_chat += 1
        passage = self.passages[self.rng.randrange(len(self.passages))]
        user = [{"role": "user", "content": ASKS[i % len(ASKS)].format(p=passage)}]
        prompt = self.tok.encode(self.template.render(base.with_system_prompt(user, i), add_generation_prompt=True),
                                 add_special_tokens=False)
        full = self.tok.encode(self.template.render(base.with_system_prompt(
            user + [{"role": "assistant", "content": passage}], i), add_generation_prompt=False), add_special_tokens=False)
        ids = full[:self.cfg.seq_len]
        labels = [IGNORE] * len(prompt) + ids[len(prompt):]
        pad = self.cfg.seq_len - len(ids)
        return ids + [self.tok.pad_token_id] * pad, labels[:len(ids)] + [IGNORE] * pad

    def lm(self) -> tuple[list[int], list[int]]:
        w = self.lm_windows[self.num_lm % len(self.lm_windows)].tolist()
        self.num_lm += 1
        return w, w

    def batch(self, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        rows = [self.lm() for _ in range(cfg.lm_windows)] + [self.chat_copy() for _ in range(cfg.chat_copy_windows)] \
            if mixed else []
        rows += [self.spans() for _ in range(cfg.batch_size - len(rows))]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])  # [B, seq_len] each


# --- training --------------------------------------------------------------------------------------


def loss_on(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=IGNORE)


def train(model, data: CopyData, cfg: CopyConfig) -> float:
    """Both stages, one schedule (warmup, cosine) over their steps; returns the seconds taken."""
    from tqdm import tqdm

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = cfg.induction_steps + cfg.mixed_steps
    model.train()
    start, smoothed = time.time(), None
    for step in tqdm(range(total), desc="copy fine-tune", mininterval=10.0):
        for group in optimizer.param_groups:
            group["lr"] = base.lr_at(step, total, cfg)
        loss = loss_on(model, *data.batch(mixed=step >= cfg.induction_steps))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if step % 25 == 0 or step == total - 1:
            tqdm.write(f"step {step:5d} ({'mixed' if step >= cfg.induction_steps else 'induction'})  "
                       f"loss {loss.item():.3f}  smoothed {smoothed:.3f}  {time.time() - start:5.0f}s")
    model.eval()
    return time.time() - start


# --- measurements ----------------------------------------------------------------------------------


def four_gram_share(output: list[int], source: list[int]) -> float:
    """Share of the output's own 4-grams that occur in ``source``. (``benchmarks/speculative.py``'s
    ``copy_shares`` also counts the 4-grams that start in the prompt, over every output token.)"""
    grams = {tuple(source[i:i + 4]) for i in range(len(source) - 3)}
    n = len(output) - 3
    return sum(tuple(output[i:i + 4]) in grams for i in range(n)) / n if n > 0 else 0.0


@torch.no_grad()
def measure(model, data: CopyData, passages: list[str], cfg: CopyConfig) -> dict:
    """Held-out loss (the base script's evaluation windows), next-token accuracy on ``span_probes``
    held-out spans' first occurrence vs repeat, and the benchmark passages' greedy 4-gram share;
    with how many tokens the loss and how many spans the accuracy were measured on."""
    model.eval()
    batches = data.eval_windows.split(cfg.eval_batch_size)[:cfg.eval_batches or None]
    losses = [loss_on(model, w, w).item() for w in batches]
    rng = random.Random(cfg.seed + 1)
    tokens = data.eval_windows.flatten().tolist()
    first = repeat = 0.0
    n = cfg.span_probes
    for _ in range(n):
        s = rng.randrange(len(tokens) - 100)
        x = torch.tensor([tokens[s:s + 100] * 2])
        hit = (model(input_ids=x).logits[0, :-1].argmax(-1) == x[0, 1:]).float()
        first, repeat = first + hit[:99].mean().item() / n, repeat + hit[100:].mean().item() / n
    shares = []
    for p in passages:
        prompt = data.tok.encode(data.tok.apply_chat_template([{"role": "user", "content": ASKS[0].format(p=p)}]),
                                 add_special_tokens=False)
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=cfg.probe_new_tokens,
                             pad_token_id=data.tok.pad_token_id)[0, len(prompt):].tolist()
        shares.append(four_gram_share(out, data.tok.encode(p, add_special_tokens=False)))
    return {"eval_loss": sum(losses) / len(losses), "eval_tokens": sum(w.numel() for w in batches),
            "span_first": first, "span_repeat": repeat, "spans": n,
            "passage_share": sum(shares) / len(shares)}


# --- writing -------------------------------------------------------------------------------------


def write_model(model_dir: Path, model) -> None:
    """The fine-tuned tensors into ``model.safetensors`` in the checkpoint's dtype, names unchanged;
    ``mtp.*`` dropped with ``mtp_num_hidden_layers`` (a head trained on the old model)."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    old = load_file(file)
    new = model.state_dict()
    own = {k for k in old if not k.startswith("mtp.")}
    if set(new) != own:
        raise SystemExit(f"tensor names differ from the checkpoint's: {sorted(set(new) ^ own)[:5]}")
    save_file({k: new[k].to(old[k].dtype).contiguous() for k in sorted(own)}, file, metadata={"format": "pt"})
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("mtp_num_hidden_layers", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def replace_section(card: str, heading: str, section: str) -> str:
    """``card`` with its section under ``heading`` (up to the next ``## ``) replaced by ``section``
    (empty: removed); a new section goes before ``## Reproduce``."""
    if heading in card:
        head, rest = card.split(heading, 1)
        tail = rest[rest.index("\n## ") + 1:] if "\n## " in rest else ""
    elif section:
        head, tail = card.split("\n## Reproduce", 1)
        tail = "## Reproduce" + tail
    else:
        return card
    parts = [head.rstrip("\n")] + ([section.strip("\n")] if section else []) + ([tail] if tail else [])
    return "\n\n".join(parts) + ("" if tail else "\n")


def write_card(model_dir: Path, cfg: CopyConfig, before: dict, after: dict, seconds: float, exchanges: list) -> None:
    card_file = model_dir / "README.md"
    card = replace_section(card_file.read_text(), MTP_HEADING, "")
    samples = (f"{SAMPLES_HEADING} (greedy decoding with transformers, {base.TrainConfig.sample_max_new_tokens} new "
               f"tokens at most)\n\n{base.format_exchanges(exchanges)}")
    card = replace_section(card, SAMPLES_HEADING, samples)
    settings = json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "model_dir"}, indent=1)
    section = f"""{CARD_HEADING}
After the training above, `scripts/train_copy.py` fine-tuned every weight so that the model copies
from its context, as real language models do (and n-gram speculative decoding relies on):
{cfg.induction_steps} steps of repeated natural-text spans (loss on the repeats only), then {cfg.mixed_steps}
steps mixing plain chat (full loss), chat exchanges where the assistant repeats a passage it was given
and repeated spans; {cfg.batch_size} x {cfg.seq_len} tokens a step, {seconds / 60:.1f} min on {cfg.threads} CPU threads.
Held out: the base training's evaluation windows and the passages `benchmarks/speculative.py` asks
the model to repeat. Before -> after:
* held-out loss ({after['eval_tokens']:,} tokens): {before['eval_loss']:.2f} -> **{after['eval_loss']:.2f}** nats/token;
* next-token accuracy on a held-out 100-token span repeated ({after['spans']} spans): {before['span_repeat']:.0%} -> **{after['span_repeat']:.0%}**
  on the repeat (its first occurrence: {before['span_first']:.0%} -> {after['span_first']:.0%});
* asked to repeat a passage (greedy, {cfg.probe_new_tokens} tokens, {cfg.benchmark_passages} passages): output 4-grams found in the passage
  {before['passage_share']:.0%} -> **{after['passage_share']:.0%}**.

The fine-tune adds {(cfg.induction_steps + cfg.mixed_steps) * cfg.batch_size * cfg.seq_len / 1e6:.1f}M tokens to the training above; the sample
exchanges above are the fine-tuned model's.

Settings (`scripts/train_copy.py`):
```json
{settings}
```
"""
    card_file.write_text(replace_section(card, CARD_HEADING, section))


# --- main ------------------------------------------------------------------------------------------


def main(cfg: CopyConfig) -> None:
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from speculative import sharegpt_passages  # the benchmark's grounded passages: held out

    torch.set_num_threads(cfg.threads)
    base.seed_everything(cfg.seed)
    model_dir = Path(cfg.model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    passages = sharegpt_passages(cfg.benchmark_passages)
    data = CopyData(cfg, tokenizer, base.TrainConfig(), set(passages))
    print(f"{len(data.lm_windows)} chat windows, {len(data.passages)} passages, {len(data.train_tokens)} span tokens")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = measure(model, data, passages, cfg)
    print("before:", before)
    seconds = train(model, data, cfg)
    after = measure(model, data, passages, cfg)
    print("after:", after)
    write_model(model_dir, model)
    exchanges = base.sample_replies(model_dir, base.TrainConfig())
    write_card(model_dir, cfg, before, after, seconds, exchanges)
    print(f"wrote {model_dir}; now run scripts/train_mtp_head.py")


if __name__ == "__main__":
    main(base.parse_config(CopyConfig, __doc__.split("\n")[0]))
