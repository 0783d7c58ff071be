"""Train the multi-token-prediction (MTP) head of the built-in default model, offline, on CPU.

    .venv/bin/python scripts/train_mtp_head.py                          # the committed head
    .venv/bin/python scripts/train_mtp_head.py --num-steps 5 --model-dir /tmp/copy   # smoke run (a copy!)

The default model (``scripts/train_default_model.py``) is a dense Qwen3-Next; Qwen3-Next checkpoints
ship an MTP head as ``mtp.*`` tensors, which hyla's ``speculative_algorithm="mtp"`` drafts with
(``hyla/model/mtp.py``). This script gives the default model one, so that ``hyla serve
--speculative-algorithm mtp`` works out of the box. Steps (seeded; ``--threads`` CPU threads):

1. Load the model with hyla in fp32 and freeze it (hyla computes the hidden states the head is
   trained on, so they are exactly the ones it drafts from): only the head is trained, and the
   model's tensors are written back untouched (their SHA-256 is checked before and after).
2. The head, built from transformers' own Qwen3-Next classes (so its tensors get the checkpoint
   names): ``fc`` over ``[pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(hidden[t])]``,
   one full-attention decoder layer (initialised from the model's last full-attention layer), a
   final norm; the model's embedding and LM head, frozen. ``hidden[t]`` is the model's final hidden
   state after its final norm, as hyla (and SGLang, vLLM) feed it.
3. Data: the ShareGPT conversations the model was trained on (``hyla/data/sharegpt.py``, rendered
   and tokenized with the same template and filters as ``train_default_model.py``), packed into
   windows whose hidden states are computed once (the model is frozen), several epochs. Loss: self-distillation — cross-entropy of the head's prediction for ``token[t+2]``
   against the *model's* distribution at ``t + 1`` (the head is judged by how often its argmax is
   the model's: that is what greedy verification accepts), AdamW, warmup + cosine schedule.
4. Write the ``mtp.*`` tensors (bf16, like the model's) into the checkpoint's ``model.safetensors``,
   add ``mtp_num_hidden_layers: 1`` to ``config.json``, and measure hyla's accept length with the new
   head on a few chat prompts; the model card (``README.md``) gets an "MTP head" section.

Run it last, after ``train_default_model.py`` and ``train_copy.py`` (each rewrites the model and drops the head).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import train_default_model as base  # noqa: E402  (its data pipeline: filters, template, packing)
from hyla.tokenizer import Tokenizer  # noqa: E402

CARD_HEADING = "## MTP head (speculative decoding)"


@dataclass(frozen=True)
class MtpConfig:
    """Every setting of the committed head (the defaults are what produced it)."""

    model_dir: str = str(REPO_ROOT / "hyla" / "assets" / "default-model")
    seed: int = 0
    threads: int = 1
    # data (the base script's filters and template)
    seq_len: int = 256
    batch_size: int = 8
    train_windows: int = 2048  # their hidden states are computed once, then reused every epoch
    eval_windows: int = 32
    # training
    num_steps: int = 1200
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    log_every: int = 20
    # the accept-length probe after writing
    probe_new_tokens: int = 64
    probe_num_steps: int = 3


class FrozenModel:
    """The model, frozen, run by hyla itself in fp32 over whole windows: the final hidden states
    (after the final norm) exactly as hyla's MTP drafter receives them, and its embedding and LM head."""

    def __init__(self, model_dir: Path, batch_size: int, seq_len: int):
        from hyla.cache import KVPool, StatePool
        from hyla.model import load_model

        self.model = load_model(model_dir, dtype="float32")
        for p in self.model.parameters():
            p.requires_grad_(False)
        layout = self.model.config.cache_layout
        self.kv_pool = KVPool.from_layout(layout, batch_size * seq_len)
        self.state_pool = StatePool.from_layout(layout, batch_size)

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, T]`` (each row a sequence from position 0) -> final hidden states ``[B, T, H]``."""
        from hyla.model.forward_batch import ForwardBatch

        b, t = ids.shape
        slots = torch.arange(1, b + 1)
        for buf in (*self.state_pool.conv_states, *self.state_pool.ssm_states):
            buf[slots] = 0  # every window starts from the zero state
        kv = torch.arange(1, b * t + 1)
        cu = torch.arange(0, b * t + 1, t)
        batch = ForwardBatch(
            is_decode=False, input_ids=ids.reshape(-1), positions=torch.arange(t).repeat(b), extend_lens=[t] * b,
            prefix_lens=[0] * b, cu_seqlens=cu, out_cache_loc=kv, kv_indices=kv, kv_indptr=cu,
            k_buffers=self.kv_pool.k_buffers, v_buffers=self.kv_pool.v_buffers, state_slots=slots,
            conv_states=self.state_pool.conv_states, ssm_states=self.state_pool.ssm_states,
            logits_indices=torch.zeros(0, dtype=torch.long), return_hidden=True,
        )
        _, hidden = self.model(batch)
        return hidden.view(b, t, -1)


class MtpHead(nn.Module):
    """The trainable head, from transformers' Qwen3-Next classes; ``state_dict`` names are the
    checkpoint's without the ``mtp.`` prefix."""

    def __init__(self, model_dir: Path, init_layer: int):
        super().__init__()
        from safetensors.torch import load_file
        from transformers import AutoConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextDecoderLayer, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding)

        cfg = AutoConfig.from_pretrained(model_dir)
        cfg.layer_types, cfg.num_hidden_layers = ["full_attention"], 1
        cfg._attn_implementation = "sdpa"
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(cfg, 0)])
        self.norm = Qwen3NextRMSNorm(h, eps=cfg.rms_norm_eps)
        self.rotary = Qwen3NextRotaryEmbedding(cfg)
        weights = load_file(model_dir / "model.safetensors")
        prefix = f"model.layers.{init_layer}."
        with torch.no_grad():
            nn.init.normal_(self.fc.weight, std=cfg.initializer_range)
            self.fc.weight[:, h:] += torch.eye(h)  # start as the decoder layer on the model's hidden state
            self.layers[0].load_state_dict({k.removeprefix(prefix): v.float() for k, v in weights.items()
                                            if k.startswith(prefix)})
            self.norm.weight.copy_(weights["model.norm.weight"].float())

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``next_embeds [B, T, H]`` = embed(token[t+1]), ``hidden [B, T, H]`` = hidden[t] ->
        ``g [B, T, H]`` (causal over t; RoPE at t)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        x = self.layers[0](x, position_embeddings=self.rotary(x, pos), position_ids=pos)
        return self.norm(x)

    def checkpoint_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {f"mtp.{k}": v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()
                if not k.startswith("rotary.")}


# --- data and loss -------------------------------------------------------------------------------


def windows(cfg: MtpConfig, tokenizer: Tokenizer) -> torch.Tensor:
    """``[N, seq_len]`` token windows of the base script's conversations, in its order."""
    data_cfg = base.TrainConfig(seed=cfg.seed)
    conversations = base.load_conversations(data_cfg)
    need = (cfg.train_windows + cfg.eval_windows) * cfg.seq_len
    stream, used = base.token_stream(conversations, tokenizer, need)
    print(f"{need} tokens from {used} conversations")
    return stream[: len(stream) // cfg.seq_len * cfg.seq_len].view(-1, cfg.seq_len)


def all_hidden(model: FrozenModel, ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The model's final hidden states of every window, ``[N, T, H]`` (computed once: the model is frozen)."""
    start = time.time()
    out = torch.cat([model.hidden(ids[i:i + batch_size]) for i in range(0, len(ids), batch_size)])
    print(f"hidden states of {len(ids)} windows: {time.time() - start:.0f}s")
    return out


def head_loss(head: MtpHead, model: FrozenModel, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Self-distillation loss over the pairs ``(token[t+1], hidden[t])``, ``t = 0..T-2`` (``ids``,
    ``hidden`` ``[B, T(, H)]``): cross-entropy against the model's distribution at ``t + 1``; and the
    share of pairs whose argmax is the model's."""
    m = model.model
    with torch.no_grad():
        target = torch.softmax(m.lm_head(hidden[:, 1:]).float(), dim=-1)  # [B, T-1, V]: the model at t + 1
        next_embeds = m.embed_tokens(ids[:, 1:])  # [B, T-1, H]
    g = head(next_embeds, hidden[:, :-1])
    logp = torch.log_softmax(m.lm_head(g).float(), dim=-1)  # [B, T-1, V]
    loss = -(target * logp).sum(-1).mean()
    agree = (logp.argmax(-1) == target.argmax(-1)).float().mean().item()
    return loss, agree


@torch.no_grad()
def evaluate(head: MtpHead, model: FrozenModel, ids: torch.Tensor, hidden: torch.Tensor,
             cfg: MtpConfig) -> tuple[float, float]:
    head.eval()
    b = cfg.batch_size
    stats = [head_loss(head, model, ids[i:i + b], hidden[i:i + b]) for i in range(0, len(ids), b)]
    head.train()
    return sum(float(s[0]) for s in stats) / len(stats), sum(s[1] for s in stats) / len(stats)


def train(head: MtpHead, model: FrozenModel, train_ids: torch.Tensor, eval_ids: torch.Tensor, cfg: MtpConfig) -> dict:
    train_hidden = all_hidden(model, train_ids, cfg.batch_size)
    eval_hidden = all_hidden(model, eval_ids, cfg.batch_size)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    epochs = -(-cfg.num_steps * cfg.batch_size // len(train_ids))
    order = torch.cat([torch.randperm(len(train_ids), generator=gen) for _ in range(epochs)])  # a shuffle per epoch
    initial = evaluate(head, model, eval_ids, eval_hidden, cfg)
    print(f"eval before training: loss {initial[0]:.3f}, top-1 agreement with the model {initial[1]:.1%}")
    start = time.time()
    for step in range(cfg.num_steps):
        idx = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        for group in opt.param_groups:
            group["lr"] = base.lr_at(step, cfg.num_steps, cfg)
        loss, agree = head_loss(head, model, train_ids[idx], train_hidden[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % cfg.log_every == 0 or step == cfg.num_steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  agreement {agree:.1%}  {time.time() - start:5.0f}s", flush=True)
    seconds = time.time() - start
    final = evaluate(head, model, eval_ids, eval_hidden, cfg)
    print(f"eval after training: loss {final[0]:.3f}, top-1 agreement with the model {final[1]:.1%} ({seconds:.0f}s)")
    return {"initial_eval_loss": initial[0], "initial_agreement": initial[1], "final_eval_loss": final[0],
            "final_agreement": final[1], "train_seconds": seconds}


# --- writing into the checkpoint ---------------------------------------------------------------


def tensor_hashes(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in tensors.items()}


def write_head(model_dir: Path, mtp: dict[str, torch.Tensor]) -> str:
    """Replace the checkpoint's ``mtp.*`` tensors by ``mtp``; the model's tensors stay bit-identical
    (checked). Returns the SHA-256 over the model's tensors."""
    from safetensors.torch import load_file, save_file

    file = model_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if not k.startswith("mtp.")}
    before = tensor_hashes(tensors)
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    after = tensor_hashes({k: v for k, v in load_file(file).items() if not k.startswith("mtp.")})
    if after != before:
        raise SystemExit("the model's own tensors changed on write: refusing to continue")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return hashlib.sha256("".join(before[k] for k in sorted(before)).encode()).hexdigest()


def probe_accept_length(model_dir: Path, cfg: MtpConfig) -> list[tuple[str, float, int]]:
    """hyla's accept length with the new head: greedy replies to the base script's sample prompts."""
    from hyla import Engine

    out = []
    with Engine(model_dir, speculative_algorithm="mtp", speculative_num_steps=cfg.probe_num_steps,
                cpu_threads=cfg.threads) as engine:
        for messages in base.SAMPLE_PROMPTS:
            ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
            res = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": cfg.probe_new_tokens})
            meta = res["meta_info"]
            out.append((messages[-1]["content"], meta.get("spec_accept_length", 1.0), meta["completion_tokens"]))
            print(f"accept length {out[-1][1]:.2f} over {out[-1][2]} tokens: {messages[-1]['content']!r}")
    return out


def write_card_section(model_dir: Path, cfg: MtpConfig, stats: dict, probe: list, base_hash: str) -> None:
    card_file = model_dir / "README.md"
    card = card_file.read_text()
    if CARD_HEADING in card:  # replace the section (up to the next top-level section)
        head, rest = card.split(CARD_HEADING, 1)
        tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
        card = head.rstrip("\n") + "\n\n" + "{section}" + tail
    else:
        card = card.replace("\n## Reproduce", "\n{section}\n## Reproduce", 1)
    probes = "\n".join(f"  * {text!r}: accept length **{acc:.2f}** over {n} tokens" for text, acc, n in probe)
    settings = json.dumps({k: v for k, v in dataclasses.asdict(cfg).items() if k != "model_dir"}, indent=1)
    section = f"""{CARD_HEADING}
The checkpoint also carries a **multi-token-prediction head** (`mtp.*` tensors, config
`mtp_num_hidden_layers: 1`) in Qwen3-Next's layout: `fc` over the normed next-token embedding and
the model's final hidden state, one full-attention decoder layer, a final norm, sharing the model's
embedding and LM head. `hyla serve --speculative-algorithm mtp` drafts with it.
* Trained by `scripts/train_mtp_head.py` with the model frozen (its tensors are bit-identical to
  before; SHA-256 over them `{base_hash[:16]}…`): {cfg.num_steps} steps of {cfg.batch_size} x {cfg.seq_len}
  tokens over {cfg.train_windows} windows of the same ShareGPT data ({stats['total_seconds'] / 60:.1f} min in all on
  {cfg.threads} CPU threads), self-distillation (cross-entropy against the model's own next-token distribution).
* Held-out: the head's argmax equals the model's next token for **{stats['final_agreement']:.0%}** of positions
  (before training, with the decoder layer copied from the model's last attention layer: {stats['initial_agreement']:.0%}).
* hyla's accept length with `speculative_num_steps={cfg.probe_num_steps}` (output tokens per verify step,
  greedy, {cfg.probe_new_tokens} new tokens at most) on the sample prompts above:
{probes}

Settings (`scripts/train_mtp_head.py`):
```json
{settings}
```
"""
    card_file.write_text(card.replace("{section}", section))


# --- main ------------------------------------------------------------------------------------------


def main(cfg: MtpConfig) -> None:
    torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model_dir = Path(cfg.model_dir)
    model = FrozenModel(model_dir, cfg.batch_size, cfg.seq_len)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    data = windows(cfg, tokenizer)
    eval_ids, train_ids = data[: cfg.eval_windows], data[cfg.eval_windows:]
    init_layer = max(i for i, t in enumerate(model.model.config.layer_types) if t == "attention")
    head = MtpHead(model_dir, init_layer)
    print(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters (decoder layer from layer {init_layer})")
    start = time.time()
    stats = train(head, model, train_ids, eval_ids, cfg)
    stats["total_seconds"] = time.time() - start
    saved = json.loads((model_dir / "config.json").read_text()).get("dtype", "bfloat16")
    base_hash = write_head(model_dir, head.checkpoint_tensors(getattr(torch, saved)))
    probe = probe_accept_length(model_dir, cfg)
    write_card_section(model_dir, cfg, stats, probe, base_hash)
    print(f"wrote the MTP head into {model_dir}")


if __name__ == "__main__":
    main(base.parse_config(MtpConfig, __doc__.split("\n")[0]))
