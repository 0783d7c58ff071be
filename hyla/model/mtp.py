"""The multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5 checkpoints: a one-layer drafter.

Qwen3-Next and Qwen3.5 checkpoints ship, beside the model, an MTP module (``mtp.*`` tensors, which
the loader sets aside in ``model.mtp_weights``; config ``mtp_num_hidden_layers``, always 1)::

    mtp.pre_fc_norm_embedding.weight  [H]       zero-centred RMSNorm of the next token's embedding
    mtp.pre_fc_norm_hidden.weight     [H]       zero-centred RMSNorm of the target's hidden state
    mtp.fc.weight                     [H, 2H]   over [norm(embedding) | norm(hidden)]
    mtp.layers.0.*                              one full-attention decoder layer, named like the
                                                model's (input_layernorm, self_attn.{q,k,v,o}_proj,
                                                self_attn.{q,k}_norm, post_attention_layernorm,
                                                mlp.*: a SwiGLU MLP, or the MoE on MoE models)
    mtp.norm.weight                   [H]       final norm; embedding and LM head are the model's

At the pair of position ``t`` (SGLang's ``qwen3_next_mtp.py``, vLLM's ``qwen3_next_mtp.py``)::

    x = fc(cat[pre_fc_norm_embedding(embed(token[t+1])), pre_fc_norm_hidden(hidden[t])])  # [T, H]
    x = layer(x)          # attention over the MTP layer's own KV of the earlier pairs, RoPE at t
    g = norm(x)           # [T, H]: the "hidden" of the next pair when drafting autoregressively
    logits = lm_head(g)   # predicts token[t+2]

``hidden[t]`` is the model's final hidden state at ``t`` *after* its final norm (what the LM head
reads; what SGLang's logits processor and vLLM's runner hand their MTP). Drafting ``k`` tokens
after ``token[n]`` runs the pair ``(token[n], hidden[n-1])`` at ``n - 1``, then ``(draft_1, g)``
at ``n``, and so on: ``k`` single-token steps (``hyla/engine/mtp_drafter.py``).

``MtpHead`` reuses the model's own classes (``Attention``, ``MLP`` / ``SparseMoE`` in a
``HybridLayer``, ``RMSNorm``) and weight specs, and shares the model's embedding, LM head and RoPE.
It reads its KV cache through a ``ForwardBatch`` whose ``k_buffers`` / ``v_buffers`` hold one
buffer (the MTP layer's, an extra attention layer of the KV pool: :func:`mtp_cache_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection

import torch
from torch import nn

from hyla.cache.layout import CacheLayout
from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import Attention, HybridForCausalLM, HybridLayer, add_rms_norm
from hyla.model.linear import Linear, relayout_weights_
from hyla.model.loader import (
    KeepFp8,
    StoredTensors,
    TensorReader,
    build_parameters,
    choose_layouts,
    copy_weights_,
    name_listing,
    quantize_the_rest_,
)
from hyla.model.quantization import attach_scales_, keep_fp8_targets
from hyla.model.qwen3_next import attention_specs, mlp_specs, moe_specs
from hyla.model.weight_specs import WeightSpec, linear_specs, norm_spec

MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
"""Architectures whose checkpoints carry an MTP head of this form."""

class MtpHead(nn.Module):
    """The MTP module of ``target`` (built empty; :meth:`from_model` loads it). Its parameters are
    only its own: the embedding, LM head and RoPE are the target's, used through ``self.target``."""

    def __init__(self, target: HybridForCausalLM):
        super().__init__()
        c = target.config
        self._target = (target,)  # a tuple: shared modules, not registered as this module's own
        h = c.hidden_size
        self.pre_fc_norm_embedding = target.new_norm()
        self.pre_fc_norm_hidden = target.new_norm()
        self.fc = Linear(2 * h, h, bias=False, dtype=c.dtype)
        self.layer = HybridLayer(mixer=Attention(c, 0), mixer_norm=target.new_norm(),
                                 ffn=target.build_ffn(mtp_ffn_kind(c)), ffn_norm=target.new_norm())
        self.norm = target.new_norm()

    @property
    def target(self) -> HybridForCausalLM:
        return self._target[0]

    @property
    def config(self) -> ModelConfig:
        """The target's config (its dtype is the head's)."""
        return self.target.config

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward over packed pairs: ``batch.input_ids [T]`` the tokens ``token[t+1]``,
        ``batch.positions [T]`` their ``t``, ``hidden [T, H]`` the hidden states ``hidden[t]``; the
        batch's single K/V buffer is the MTP layer's (it writes each pair's K/V at
        ``batch.out_cache_loc`` and attends over ``batch.kv_indices`` as any attention layer).
        Returns ``(logits [N, vocab] fp32 at batch.logits_indices (every pair when None), g [T, H])``."""
        g = self.hidden_states(batch, hidden)  # [T, H]
        rows = g if batch.logits_indices is None else g[batch.logits_indices]
        return self.target.lm_head(rows).float(), g

    @torch.no_grad()
    def hidden_states(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` up to the LM head: ``g [T, H]`` (what ``compile_decode`` compiles of the
        head: ``hyla/engine/mtp_drafter.py``)."""
        target = self.target
        e = target.embed_tokens(batch.input_ids)  # [T, H]
        x = torch.cat([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1)
        x, rope = self.fc(x), target.rope(batch, e)  # [T, H]
        if batch.fused_decode:  # as the model's fused step: each residual add inside the next norm's kernel
            out, residual = self.layer.forward_fused(None, x, batch, rope)
            return add_rms_norm(out, residual, self.norm)[0]  # [T, H]
        return self.norm(self.layer(x, batch, rope))  # [T, H]

    @classmethod
    def from_model(cls, model: HybridForCausalLM, take: bool = False) -> "MtpHead":
        """The MTP head from ``model.mtp_weights``: its projections and experts float8 with their
        scales where the loader kept those tensors so (``model.mtp_scales``: ``load_model(keep_fp8=True)``),
        as the model's own, and the rest of them quantized where the model's were (``quantize_fp8``). ``take``: the head takes them — ``model.mtp_weights`` is emptied, so that
        the device holds them once (an engine's head: a weight update writes the head itself).
        ``ValueError`` when the model has none, is not a Qwen3-Next / Qwen3.5 model, asks for more
        than one MTP layer, or when the ``mtp.*`` tensors are not exactly the ones the head needs
        (missing / unexpected names, wrong shapes)."""
        c = model.config
        if not model.mtp_weights:
            raise ValueError("this model has no mtp.* tensors: its checkpoint has none (speculative_algorithm='mtp' "
                             "needs a checkpoint with an MTP head), it was loaded with load_model(mtp=False), or a "
                             "head took them (MtpHead.from_model(take=True))")
        if c.model_type not in MTP_MODEL_TYPES:
            raise ValueError(f"MTP heads are supported for {MTP_MODEL_TYPES}, not {c.architecture}")
        if c.mtp_num_hidden_layers not in (0, 1):
            raise ValueError(f"mtp_num_hidden_layers is {c.mtp_num_hidden_layers}: hyla runs one MTP layer")
        with torch.device("meta"):
            head = cls(model)
        stored = StoredTensors(model.mtp_weights, model.mtp_scales)
        keep = KeepFp8(stored, keep_fp8_targets(head)) if model.mtp_scales or model.quantized_at_load else None
        specs = head.weight_specs(set(model.mtp_weights))
        state = build_parameters(specs, dict(head.named_parameters(remove_duplicate=False)), stored.get,
                                 model.embed_tokens.weight.device, owner=_OWNER, keep=keep,
                                 copy=not take)  # (taken: the model's tensors become the head's, no copy)
        if model.quantized_at_load:  # quantization="fp8": the head's others too, as the model's
            quantize_the_rest_(state, keep)
        head.load_state_dict(state, strict=True, assign=True)
        if keep is not None:
            attach_scales_(head, keep.scales)
        relayout_weights_(head)
        if take:
            model.mtp_weights, model.mtp_scales = {}, {}
        return head.eval()

    def state_from(self, weights: dict[str, torch.Tensor],
                   device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """This head's parameters built from a checkpoint's ``mtp.*`` tensors, by name, on ``device``
        (default: the target's; the head itself may be on the meta device). ``ValueError`` when there
        are none, or they are not exactly the ones the head needs (missing / unexpected, wrong
        shapes). A check from the headers alone: meta tensors (``loader.TensorReader.meta``),
        ``device="meta"``, called under ``torch.device("meta")`` (the specs' own constants meta too)."""
        specs = self.weight_specs(set(weights))
        device = self.target.embed_tokens.weight.device if device is None else device
        return build_parameters(specs, dict(self.named_parameters(remove_duplicate=False)), weights.__getitem__,
                                device, owner=_OWNER)

    def copy_from_(self, names: set[str], get: Callable[[str], torch.Tensor], prefix: str = "",
                   tensors: TensorReader | None = None) -> None:
        """Write this head's parameters in place from a checkpoint's ``mtp.*`` tensors (``names``,
        read by ``get(name)``), one parameter at a time (``loader.copy_weights_``): what
        :meth:`state_from` builds, with its errors; a float8 parameter from ``tensors`` (the checkpoint's
        reader) as stored where they hold it quantized in its blocks."""
        copy_weights_(self, self.weight_specs(names), get, prefix=prefix, owner=_OWNER, tensors=tensors)

    def weight_specs(self, names: set[str]) -> list[WeightSpec]:
        """How this head's parameters are built from a checkpoint whose ``mtp.*`` tensors are ``names``
        (one spec per parameter, in the layout the checkpoint holds: ``choose_layouts``).
        ``ValueError`` when there are none, or they are not exactly the ones the head needs."""
        _require_mtp_tensors(names)
        specs = choose_layouts(mtp_weight_specs(self.target.config), names)
        needed = {name for spec in specs for name in spec.sources}
        missing, unexpected = needed - names, names - needed
        if missing or unexpected:
            raise ValueError("the checkpoint's mtp.* tensors do not fit its config: "
                             + "; ".join(f"{what}: {name_listing(listed)}" for what, listed in
                                         (("missing", missing), ("unexpected", unexpected)) if listed))
        return specs


_OWNER = "the MTP head's "
"""Whose parameters the loader's messages about the head's weights name (its ``owner``)."""


def _require_mtp_tensors(names: Collection[str]) -> None:
    if not names:
        raise ValueError("this checkpoint has no mtp.* tensors: speculative_algorithm='mtp' needs a "
                         "checkpoint with an MTP head (Qwen3-Next / Qwen3.5)")


def mtp_ffn_kind(config: ModelConfig) -> str:
    """The MTP layer's feed-forward: the MoE on MoE models, else a dense SwiGLU MLP."""
    return "moe" if config.num_experts else "mlp"


def mtp_weight_specs(config: ModelConfig) -> list[WeightSpec]:
    """Where each ``mtp.*`` tensor goes in :class:`MtpHead` (the decoder layer with the model's own
    specs; MoE experts fused as published (``experts.gate_up_proj`` / ``down_proj``) or per expert,
    whichever the checkpoint holds: ``choose_layouts``)."""
    s = "mtp.layers.0"
    specs = [
        norm_spec("pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_embedding.weight"),
        norm_spec("pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight"),
        *linear_specs("fc", ["mtp.fc"], False),
        norm_spec("layer.mixer_norm.weight", f"{s}.input_layernorm.weight"),
        norm_spec("layer.ffn_norm.weight", f"{s}.post_attention_layernorm.weight"),
        *attention_specs(config, "layer.mixer", f"{s}.self_attn"),
        norm_spec("norm.weight", "mtp.norm.weight"),
    ]
    if mtp_ffn_kind(config) == "moe":
        specs += [WeightSpec("layer.ffn.w_in", (f"{s}.mlp.experts.gate_up_proj",)),  # [E, 2I, H]: [gate | up]
                  WeightSpec("layer.ffn.w_out", (f"{s}.mlp.experts.down_proj",))]  # [E, H, I]
        specs += moe_specs(config, "layer.ffn", f"{s}.mlp")
    else:
        specs += mlp_specs("layer.ffn", f"{s}.mlp")
    return specs


def mtp_cache_layout(config: ModelConfig) -> CacheLayout:
    """The model's cache layout with MTP on: one more attention layer of KV per token (the MTP
    layer's, last in the pool) and the model's last hidden state (``hidden_size`` in its dtype) in
    every state slot, carried with the recurrent state it follows (``StatePool.hidden_states``)."""
    base = config.cache_layout
    return dataclasses.replace(base, num_attention_layers=base.num_attention_layers + 1,
                               hidden_size=config.hidden_size, hidden_dtype=config.dtype)

