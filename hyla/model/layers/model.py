"""The residual layer and the model skeleton every architecture plugs its mixers into."""

from __future__ import annotations

import abc
import functools

import torch
from torch import nn

from hyla.model.config import ModelConfig
from hyla.model.forward_batch import ForwardBatch
from hyla.model.layers import device
from hyla.model.layers.attention import Attention, runs_prologue_kernel
from hyla.model.layers.gated_deltanet import GatedDeltaNet
from hyla.model.layers.mamba2 import Mamba2Mixer
from hyla.model.layers.mlp import MLP
from hyla.model.layers.norms import RMSNorm
from hyla.model.layers.projections import OutProjection, add_rms_norm, is_gemv_step, materialized, on_gemv_step
from hyla.model.layers.rotary import Rope, RotaryEmbedding, signed_sin
from hyla.model.layers.sparse_moe import SparseMoE
from hyla.model.linear import Linear, relayout_weights_
from hyla.model.lora import LoRAScope
from hyla.model.vision import mrope_frequency_axes
from hyla.model.weight_specs import WeightSpec


class HybridLayer(nn.Module):
    """One residual layer: ``x + mixer(mixer_norm(x))`` then ``x + ffn(ffn_norm(x))``; either part
    may be absent (NemotronH blocks hold exactly one of them)."""

    def __init__(self, mixer: nn.Module | None, mixer_norm: nn.Module | None,
                 ffn: nn.Module | None, ffn_norm: nn.Module | None):
        super().__init__()
        self.mixer, self.mixer_norm, self.ffn, self.ffn_norm = mixer, mixer_norm, ffn, ffn_norm

    def mixers(self) -> list[nn.Module]:
        """The layer's token mixers (none in a NemotronH FFN block; Falcon-H1's layer has two)."""
        return [] if self.mixer is None else [self.mixer]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        if self.mixer is not None:
            x = x + self.mixer(self.mixer_norm(x), batch, rope)
        if self.ffn is not None:
            x = x + self.ffn(self.ffn_norm(x))
        return x

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor | OutProjection, torch.Tensor]:
        """:meth:`forward` with each residual add fused into the norm after it (the fused decode
        step, CUDA extend steps; the same numbers): the layer's input is ``residual + out`` (``out``
        None: just ``residual``), its output the same pair, the last part's output not yet added.
        A fused decode step of at most ``gemv.MAX_ROWS`` rows is a *GEMV step*: each part runs its in
        projection as a GEMV (:func:`in_projection`) and leaves its out projection to the next
        norm's kernel (:class:`OutProjection`); a part's module says it takes such a step with
        ``takes_gemv_step`` and its forward's ``gemv_step=True``."""
        gemv_step = is_gemv_step(batch, residual)
        if self.mixer is not None:
            h, residual = add_rms_norm(out, residual, self.mixer_norm)
            out = on_gemv_step(self.mixer, gemv_step)(h, batch, rope)
        if self.ffn is not None:
            h, residual = add_rms_norm(out, residual, self.ffn_norm)
            out = on_gemv_step(self.ffn, gemv_step)(h)
        return out, residual


class PostNormLayer(HybridLayer):
    """A residual layer with OLMo-2/3's reordered norms (OLMo-Hybrid's attention layers): each norm
    on its part's output, none on the input: ``x + mixer_norm(mixer(x))`` then ``x + ffn_norm(ffn(x))``.
    Both parts are required."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        x = x + self.mixer_norm(self.mixer(x, batch, rope))
        return x + self.ffn_norm(self.ffn(x))

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` in :meth:`HybridLayer.forward_fused`'s contract: the input ``residual + out``
        from the add-norm kernel (its norm unused: ``out`` may be the layer before's deferred GEMV
        projection), each part's output materialised for its norm (on a GEMV step its projections are
        GEMVs too: :meth:`OutProjection.run`), the last add left to the next layer's kernel:
        ``(ffn_norm(ffn(x)), x)``."""
        gemv_step = is_gemv_step(batch, residual)
        x = residual if out is None else add_rms_norm(out, residual, self.mixer_norm)[1]
        x = x + self.mixer_norm(materialized(on_gemv_step(self.mixer, gemv_step)(x, batch, rope)))
        return self.ffn_norm(materialized(on_gemv_step(self.ffn, gemv_step)(x))), x


class SandwichLayer(HybridLayer):
    """A residual layer with each part between two norms (LFM3's ``use_sandwich_norm``):
    ``x + post_mixer_norm(mixer(mixer_norm(x)))`` then ``x + post_ffn_norm(ffn(ffn_norm(x)))``. Both parts
    are required."""

    def __init__(self, mixer: nn.Module, mixer_norm: nn.Module, ffn: nn.Module, ffn_norm: nn.Module,
                 post_mixer_norm: nn.Module, post_ffn_norm: nn.Module):
        super().__init__(mixer, mixer_norm, ffn, ffn_norm)
        self.post_mixer_norm, self.post_ffn_norm = post_mixer_norm, post_ffn_norm

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope | None) -> torch.Tensor:
        x = x + self.post_mixer_norm(self.mixer(self.mixer_norm(x), batch, rope))
        return x + self.post_ffn_norm(self.ffn(self.ffn_norm(x)))

    def forward_fused(self, out: torch.Tensor | OutProjection | None, residual: torch.Tensor, batch: ForwardBatch,
                      rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` in :meth:`HybridLayer.forward_fused`'s contract: each input norm in the
        add-norm kernel, each part's output materialised for its post-norm (on a GEMV step its projections
        are GEMVs too: :meth:`OutProjection.run`), the last add left to the next layer's kernel."""
        gemv_step = is_gemv_step(batch, residual)
        h, residual = add_rms_norm(out, residual, self.mixer_norm)
        out = self.post_mixer_norm(materialized(on_gemv_step(self.mixer, gemv_step)(h, batch, rope)))
        h, residual = add_rms_norm(out, residual, self.ffn_norm)
        return self.post_ffn_norm(materialized(on_gemv_step(self.ffn, gemv_step)(h))), residual


class HybridForCausalLM(nn.Module, abc.ABC):
    """Embedding -> hybrid layers -> final norm -> lm_head, driven by a ``ForwardBatch``.

    Subclasses (one per architecture) build ``self.layers`` from the config and describe how HF
    checkpoint tensors map onto their parameters (``hf_weight_specs``). ``mtp_weights`` holds the
    checkpoint's multi-token-prediction tensors (``mtp.*``) for speculative decoding, where the loader
    read them (``load_model(mtp=True)``); ``mtp_scales`` the scales of those it kept float8.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        # no random init (the loader fills every parameter): nn.Embedding's normal_ on the meta device
        # goes through a decomposition that imports torch._dynamo, ~2-4 s of every engine's start-up
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size,
                                         _weight=torch.empty(c.vocab_size, c.hidden_size, dtype=c.dtype))
        self.visual: nn.Module | None = None  # a vision tower (vision.py: Qwen3.5 vision-language checkpoints)
        self.build_shared()
        self.layers = nn.ModuleList([self.build_layer(i) for i in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, c.zero_centered_norm, c.dtype)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)
        self.lm_head.keeps_fp8 = False  # (the logits in the model's precision, as vLLM and SGLang keep them)
        self.lm_head.lora_refused = "the LM head projects the rows kept for logits, not every token row"
        self.lora_scope: LoRAScope | None = None  # LoRA adapters (lora.enable_lora_): each step's bound to it
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta, c.rope_angles or None) \
            if c.rotary_dim and c.num_attention_layers else None
        # sliding-window layers' own RoPE (sliding_rope; None: theirs is self.rotary, or none at all)
        self.sliding_rotary = RotaryEmbedding(*c.sliding_rope) if c.sliding_rope and c.sliding_rope[0] else None
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self.mtp_scales: dict[str, tuple[torch.Tensor, tuple[int, int]]] = {}  # the float8 ones': (scales, block)
        self.quantized_at_load = False  # load_model(quantize_fp8=True): its projections and experts quantized
        self.register_load_state_dict_post_hook(lambda module, _keys: module.relayout_weights_())

    def relayout_weights_(self) -> None:
        """Store fp32 CPU projection weights column-major (runs after ``load_state_dict``; see
        :func:`relayout_weights_`). A tied lm_head shares the embedding's storage and keeps its layout."""
        relayout_weights_(self, keep=self.embed_tokens.weight)

    # --- construction (architecture files override) ---
    def build_shared(self) -> None:
        """Modules several layers use, built before the layers (Zamba2's shared blocks); none by default."""

    @abc.abstractmethod
    def build_layer(self, index: int) -> HybridLayer:
        """Layer ``index`` of this architecture, from ``self.config``."""

    @classmethod
    @abc.abstractmethod
    def hf_weight_specs(cls, config: ModelConfig) -> list[WeightSpec]:
        """Every tensor the Hugging Face checkpoint must hold, and where it goes."""

    @classmethod
    def normalize_hf_name(cls, name: str) -> str | None:
        """Map a checkpoint tensor name to the name ``hf_weight_specs`` uses; ``None`` = ignore it."""
        return name

    @classmethod
    def ignores_hf_name(cls, config: ModelConfig, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` is one this model, as ``config`` describes it, never
        reads (Ling 3's multi-token-prediction layers, numbered after the decoder's); asked before
        :meth:`normalize_hf_name`."""
        return False

    attention_mixer: type[nn.Module] = Attention  # the mixer of "attention" layers (Kimi-Linear: MLA)
    # every layer's forward and forward_fused also take the token embeddings (embeds=, [T, hidden]; Zamba2's)
    layers_read_embeddings: bool = False
    linear_mixer: type[nn.Module] | None = None  # of "linear" layers; None: GatedDeltaNet / Mamba2Mixer (linear_kind)

    def build_mixer(self, index: int) -> nn.Module:
        """The mixer of an ``"attention"`` or ``"linear"`` layer, built as ``cls(config, ordinal)``."""
        c = self.config
        if c.layer_types[index] == "attention":
            window = c.attention_window(index)  # a sliding window: plain attention only (ModelConfig checks)
            return self.attention_mixer(c, c.attention_ordinal(index), **({"window": window} if window else {}))
        mixer = self.linear_mixer or (GatedDeltaNet if c.linear_kind == "gdn" else Mamba2Mixer)
        return mixer(c, c.linear_ordinal(index))

    def build_ffn(self, kind: str) -> nn.Module:
        c = self.config
        if kind == "moe":
            return SparseMoE(c)
        return MLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias, c.dtype)

    def mixer_ffn_layer(self, index: int) -> HybridLayer:
        """The decoder layer of most architectures: ``x + mixer(norm(x))`` (:meth:`build_mixer`), then
        ``x + ffn(norm(x))`` (``config.ffn_types[index]``)."""
        return HybridLayer(mixer=self.build_mixer(index), mixer_norm=self.new_norm(),
                           ffn=self.build_ffn(self.config.ffn_types[index]), ffn_norm=self.new_norm())

    def new_norm(self) -> RMSNorm:
        c = self.config
        return RMSNorm(c.hidden_size, c.norm_eps, c.zero_centered_norm, c.dtype)

    # --- what the fused (Triton) decode step covers ---
    def supports_fused_decode(self) -> bool:
        """Every mixer has a fused decode path (its class sets ``fused_decode``: every mixer of every
        architecture now — full attention, Gated DeltaNet, Mamba2, Mamba1, LFM2's short conv, KDA and
        MLA, Falcon-H1's parallel pair included)."""
        return all(getattr(mixer, "fused_decode", False) for layer in self.layers for mixer in layer.mixers())

    @functools.cached_property
    def _rotates_in_pytorch(self) -> bool:
        """Some mixer applies RoPE with the PyTorch ops on every path (its ``rotates_in_pytorch``)."""
        return any(getattr(m, "rotates_in_pytorch", False) for layer in self.layers for m in layer.mixers())

    @functools.cached_property
    def _residual_fusable(self) -> bool:
        """The fused decode step and CUDA extend steps may run :meth:`HybridLayer.forward_fused`
        (Falcon-H1's parallel layer has its own): every norm an :class:`RMSNorm`."""
        norms = [self.norm] + [n for layer in self.layers for n in (layer.mixer_norm, layer.ffn_norm) if n is not None]
        return all(type(n) is RMSNorm for n in norms)

    def supports_chain_verify(self) -> bool:
        """Every mixer runs a verify step of padded chains (``ForwardBatch.chain_ckpt_rows``, the
        compiled verify step): its class says so with ``chain_verify`` (every mixer hyla has: attention, MLA,
        Gated DeltaNet, KDA, Mamba1, Mamba2, MiniMax's lightning attention, LFM2's short convolution; a new
        mixer is eager until it says so)."""
        return all(getattr(mixer, "chain_verify", False) for layer in self.layers for mixer in layer.mixers())

    def supports_fused_extend(self) -> bool:
        """Every mixer runs a fused extend (``ForwardBatch.fused_extend``: full attention, Gated
        DeltaNet, Mamba2, Mamba1, KDA, MLA and LFM2's short conv — every mixer of every architecture now
        —, whose extend kernels read only device indices): what a CUDA graph of an
        extend needs (MoE layers read nothing on the host on a GPU either: :meth:`SparseMoE.path`)."""
        return all(getattr(mixer, "fused_extend", False) for layer in self.layers for mixer in layer.mixers())

    def fuse_moe_inputs_(self) -> int:
        """:meth:`SparseMoE.fuse_inputs_` in every MoE layer (a GPU runner's, once the weights are on
        their device); returns how many fused."""
        return sum(m.fuse_inputs_() for m in self.modules() if isinstance(m, SparseMoE))

    # --- forward ---
    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the batch's new tokens; return fp32 logits ``[N, vocab]`` at ``batch.logits_indices``
        (default: the last new token of each sequence), with ``batch.return_hidden`` also the final
        hidden states ``[T, hidden]`` of every new token (after the final norm). With LoRA adapters
        (``lora_scope``), the batch's (``batch.lora``) apply for its length."""
        self.check_batch(batch)
        return self.forward_unchecked(batch)

    @torch.no_grad()
    def forward_unchecked(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` without :meth:`check_batch` (the runner checks, then runs this compiled:
        the checks read host ints a compiled graph would specialise on; or captured in a CUDA graph)."""
        if self.lora_scope is None:
            return self._forward(batch)
        with self.lora_scope.bind(batch.lora):  # the projections' adapters apply to the rows it groups
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.embed_tokens(batch.input_ids)  # [T, hidden]
        if batch.mm_rows is not None:  # image placeholders: the vision tower's embeddings instead
            h = h.index_put((batch.mm_rows,), batch.mm_embeds.to(h.dtype))
        ropes = self.layer_ropes(batch, h)
        embeds = {"embeds": h} if self.layers_read_embeddings else {}  # (nothing writes h in place)
        if (batch.on_device or device.on_gpu(h)) and self._residual_fusable:  # each residual add in the next
            # norm's kernel
            out, residual = None, h
            for layer, rope in zip(self.layers, ropes):
                out, residual = layer.forward_fused(out, residual, batch, rope, **embeds)
            if batch.fused_decode:
                h, _ = add_rms_norm(out, residual, self.norm)  # [B, hidden]
                logits = self.lm_head(h).float()  # [B, vocab]
                return (logits, h) if batch.return_hidden else logits
            h = residual + out  # [T, hidden]: the last add (the final norm runs on the rows kept below)
        else:
            for layer, rope in zip(self.layers, ropes):
                h = layer(h, batch, rope, **embeds)
        if batch.return_hidden:
            h = self.norm(h)  # [T, hidden]: every new token's final hidden state
            rows = h[batch.logits_indices] if batch.logits_indices is not None else (
                h if batch.is_decode or batch.chain_ckpt_rows is not None else h[batch.last_token_indices()])
            return self.lm_head(rows).float(), h  # [N, vocab], [T, hidden]
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        elif not batch.is_decode and batch.chain_ckpt_rows is None:  # decode, chains: every token's
            h = h[batch.last_token_indices()]
        return self.lm_head(self.norm(h)).float()  # [N, vocab]

    def rope(self, batch: ForwardBatch, x: torch.Tensor, rotary: RotaryEmbedding | None = None) -> Rope | None:
        """The batch's :class:`Rope` of ``rotary`` (default: the model's), once per step for every
        attention layer (``x``: the hidden states, for their dtype and device); its tables only where
        attention runs the PyTorch path, or where a mixer always rotates in PyTorch (Ling 3's MLA:
        ``rotates_in_pytorch``). None without RoPE."""
        rotary = self.rotary if rotary is None else rotary
        if rotary is None:
            return None
        if runs_prologue_kernel(batch, x) and not self._rotates_in_pytorch:
            return Rope(batch.positions, rotary.inv_freq, None, None)
        if batch.mrope_positions is not None:  # an image's tokens: each frequency reads its own axis
            cos, sin = rotary(batch.mrope_positions[self._mrope_axes(rotary)], x.dtype)
        else:
            cos, sin = rotary(batch.positions, x.dtype)
        return Rope(batch.positions, rotary.inv_freq, cos, signed_sin(sin))

    def _mrope_axes(self, rotary: RotaryEmbedding) -> torch.Tensor:
        """The position component (0 time, 1 height, 2 width) each of ``rotary``'s frequencies reads
        (``vision.mrope_frequency_axes``); ``ValueError`` for a model without a vision tower."""
        if self.config.vision is None:
            raise ValueError(f"{self.config.architecture}: multimodal positions need a vision-language model")
        return mrope_frequency_axes(self.config.vision.mrope_section, rotary.inv_freq.numel())

    def layer_ropes(self, batch: ForwardBatch, x: torch.Tensor) -> list[Rope | None]:
        """Each layer's :class:`Rope` (:meth:`rope`): the model's, but a sliding-window layer's own
        where the model gives it one (``config.sliding_rope``: Lara-4-Mini's sliding layers rotate and its
        global ones do not; LFM3's rotate with another theta and all their channels)."""
        rope = self.rope(batch, x)
        c = self.config
        if c.sliding_rope is None:
            return [rope] * len(self.layers)
        sliding = self.rope(batch, x, self.sliding_rotary) if self.sliding_rotary is not None else None
        return [sliding if i in c.sliding_layers else rope for i in range(len(self.layers))]

    def check_batch(self, batch: ForwardBatch) -> None:
        """``ValueError`` unless the batch fits this model (pools per layer kind, token ids)."""
        c = self.config
        if len(batch.k_buffers) != c.num_attention_layers or len(batch.v_buffers) != c.num_attention_layers:
            raise ValueError(f"the model has {c.num_attention_layers} attention layers, the batch brings "
                             f"{len(batch.k_buffers)} K and {len(batch.v_buffers)} V buffers")
        if len(batch.conv_states) != c.num_linear_layers or len(batch.ssm_states) != c.num_linear_layers:
            raise ValueError(f"the model has {c.num_linear_layers} linear layers, the batch brings "
                             f"{len(batch.conv_states)} conv and {len(batch.ssm_states)} SSM state buffers")
        if batch.chain_ckpt_rows is not None and not self.supports_chain_verify():
            raise ValueError(f"{c.architecture}: a verify step of padded chains needs mixers that run them "
                             "(chain_verify: HybridForCausalLM.supports_chain_verify)")
        if batch.lora is not None and (self.lora_scope is None or batch.lora.num_rows != batch.input_ids.shape[0]):
            raise ValueError("a batch's LoRA rows must be its token rows, on a model serving adapters (lora.enable_lora_)"
                             if self.lora_scope is not None else "this model serves no LoRA adapters (lora.enable_lora_)")
        if batch.mm_rows is not None and (self.visual is None or batch.mm_embeds.shape[1] != c.hidden_size):
            raise ValueError(f"image embeddings need a vision-language model with hidden size {c.hidden_size}")
        if batch.max_token_id >= c.vocab_size:  # read once when the batch was built, not here
            raise ValueError(f"token id {batch.max_token_id} is outside the vocabulary ({c.vocab_size})")
