"""How each hyla parameter is built from a Hugging Face checkpoint's tensors (``WeightSpec``), and
the checkpoint layouts of the shared layers (``embedding_specs``, ``attention_specs``,
``mamba2_specs``, ``mlp_specs``), which the architecture files call with their source names and
µP factors. The loader (``loader.py``) picks a layout per parameter and applies it.

µP multipliers (Falcon-H1, Granite 4.0-H) are linear in a weight: they are folded into the weights
at load time, in fp32 before the cast to the model dtype, and the forward pass has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hyla.model.config import ModelConfig


@dataclass(frozen=True)
class WeightSpec:
    """How one hyla parameter is built from Hugging Face checkpoint tensors:
    ``param = combine([tensor(name) for name in sources])``."""

    target: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None  # None: the single source as is

    def build(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0] if self.combine is None else self.combine(tensors)

    @property
    def moves_rows_only(self) -> bool:
        """Whether the parameter is its sources' rows, moved (copied, concatenated, stacked) but not
        changed: built the same way, float8 sources and their block scales make it in float8
        (``quantization.py``: weights kept in FP8)."""
        return self.combine is None or getattr(self.combine, "moves_rows_only", False)


def renamed(name: str, renames: Sequence[tuple[str, str]]) -> str:
    """``name`` with each ``(old, new)`` substring replaced, in order: a checkpoint's other spelling
    (transformers' in-memory names) to the one an architecture's ``hf_weight_specs`` reads."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


def concat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


concat_rows.moves_rows_only = True
concat_rows.rows_group = 0  # every source's rows in one matrix


RowSegment = tuple[int, int, int]  # (source index, first row, rows)


def row_segments(segments: Callable[[list[tuple[int, ...]]], list[RowSegment]]) -> Callable[[list[torch.Tensor]],
                                                                                          torch.Tensor]:
    """A combine that regroups rows: its matrix is the row ranges ``segments(the sources' shapes)`` lists,
    ``[(source, first row, rows), ...]``, one after another (a per-head layout made contiguous, as
    Qwen3-Next's in projection). It changes no value, and the loader keeps float8 sources float8 through
    it where each range is whole blocks of rows: their scales' rows move the same way
    (``loader._fp8_plan``)."""

    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[s][first:first + rows] for s, first, rows in segments([tuple(t.shape)
                                                                                          for t in tensors])])

    combine.moves_rows_only = True
    combine.row_segments = segments
    return combine


def concat_convs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Depthwise ``conv1d.weight [C_i, 1, K]`` tensors (separate q / k / v convs, or one fused) -> ``[sum C_i, K]``."""
    return torch.cat([w.squeeze(1) for w in tensors], dim=0)


def squeeze_conv(tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF depthwise ``conv1d.weight [C, 1, K]`` -> ``[C, K]``."""
    return tensors[0].squeeze(1)


def stack_experts(parts_per_expert: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Sources are ``parts_per_expert`` tensors per expert, expert-major: concatenate each expert's
    parts by rows, then stack the experts -> ``[E, rows, cols]``."""

    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        groups = [tensors[i : i + parts_per_expert] for i in range(0, len(tensors), parts_per_expert)]
        return torch.stack([torch.cat(g, dim=0) for g in groups])

    combine.moves_rows_only = True
    combine.rows_group = parts_per_expert  # each expert's matrix: this many sources' rows
    return combine


def norm_spec(target: str, source: str) -> WeightSpec:
    return WeightSpec(target, (source,))


def linear_specs(target: str, sources: Sequence[str], bias: bool) -> list[WeightSpec]:
    """``target.weight`` (and ``.bias``) as the row-concatenation of the sources' ``.weight`` (``.bias``)."""
    combine = concat_rows if len(sources) > 1 else None
    specs = [WeightSpec(f"{target}.weight", tuple(f"{s}.weight" for s in sources), combine)]
    if bias:
        specs.append(WeightSpec(f"{target}.bias", tuple(f"{s}.bias" for s in sources), combine))
    return specs


Scale = float | torch.Tensor  # a scalar, or one factor per output row


def scaled_rows(*scales: Scale) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """Combine: source ``i`` (a weight ``[rows, cols]`` or a bias ``[rows]``) times ``scales[i]``, in
    fp32, concatenated by rows. A tensor scale has one factor per row of its source."""

    def combine(tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) != len(scales):
            raise ValueError(f"internal: {len(tensors)} tensors for {len(scales)} scales")
        out = []
        for tensor, scale in zip(tensors, scales):
            if isinstance(scale, torch.Tensor):
                scale = scale.reshape(-1, *([1] * (tensor.dim() - 1)))  # [rows, 1...]
            out.append(tensor.float() * scale)
        return torch.cat(out, dim=0)

    return combine


def scaled_linear(target: str, sources: Sequence[str], weight_scales: Sequence[Scale],
                  bias_scales: Sequence[Scale] | None) -> list[WeightSpec]:
    """``target.weight`` (and ``.bias`` when ``bias_scales``): the sources' rows, each times its
    scale (all scales 1.0: a plain copy / row concatenation, ``linear_specs``)."""
    if all(isinstance(f, float) and f == 1.0 for f in (*weight_scales, *(bias_scales or ()))):
        return linear_specs(target, sources, bias_scales is not None)
    specs = [WeightSpec(f"{target}.weight", tuple(f"{s}.weight" for s in sources), scaled_rows(*weight_scales))]
    if bias_scales is not None:
        specs.append(WeightSpec(f"{target}.bias", tuple(f"{s}.bias" for s in sources), scaled_rows(*bias_scales)))
    return specs


# --- the checkpoint layouts of the shared layers --------------------------------------------------


def embedding_specs(config: ModelConfig, embed: str, final_norm: str, tied: bool | None = None,
                    embed_scale: float = 1.0, lm_head_scale: float = 1.0) -> list[WeightSpec]:
    """``embed_tokens`` (times ``embed_scale``), the final ``norm`` and ``lm_head`` (times
    ``lm_head_scale``): the checkpoint's ``lm_head.weight``, or the embedding when ``tied``
    (default ``tie_word_embeddings``; a scaled tied ``lm_head`` is its own copy)."""
    tied = config.tie_word_embeddings if tied is None else tied

    def spec(target: str, source: str, scale: float) -> WeightSpec:
        return WeightSpec(target, (source,), None if scale == 1.0 else scaled_rows(scale))

    return [
        spec("embed_tokens.weight", embed, embed_scale),
        norm_spec("norm.weight", final_norm),
        spec("lm_head.weight", embed if tied else "lm_head.weight", lm_head_scale),
    ]


def attention_specs(config: ModelConfig, target: str, source: str, qkv_scales: Sequence[Scale] = (1.0, 1.0, 1.0),
                    bias_scales: Sequence[Scale] = (1.0, 1.0, 1.0), out_scale: float = 1.0, o_proj: str = "o_proj",
                    qk_norms: tuple[str, str] = ("q_norm", "k_norm")) -> list[WeightSpec]:
    """:class:`Attention` from HF's ``q_proj`` / ``k_proj`` / ``v_proj`` (stacked into ``qkv_proj``, the
    rows of each times its ``qkv_scales`` entry, its bias times ``bias_scales``) and output projection
    (named ``o_proj``; weight and bias times ``out_scale``), biases when ``attention_bias``; with
    ``qk_norm``, the per-head norms' weights (named ``qk_norms``: q's, k's)."""
    c = config
    qkv = [f"{source}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    specs = [
        *scaled_linear(f"{target}.qkv_proj", qkv, qkv_scales, bias_scales if c.attention_bias else None),
        *scaled_linear(f"{target}.o_proj", [f"{source}.{o_proj}"], (out_scale,),
                       (out_scale,) if c.attention_bias else None),
    ]
    if c.qk_norm:
        specs += [norm_spec(f"{target}.q_norm.weight", f"{source}.{qk_norms[0]}.weight"),
                  norm_spec(f"{target}.k_norm.weight", f"{source}.{qk_norms[1]}.weight")]
    return specs


def mamba2_specs(config: ModelConfig, target: str, source: str, in_scale: Scale = 1.0, in_bias_scale: Scale = 1.0,
                 out_scale: float = 1.0) -> list[WeightSpec]:
    """:class:`Mamba2Mixer` from HF's Mamba2 mixer layout (NemotronH, Bamba, Granite 4.0-H, Falcon-H1):
    ``in_proj`` (rows times ``in_scale``, bias times ``in_bias_scale``), ``conv1d``, ``dt_bias``,
    ``A_log``, ``D``, the gated ``norm`` when ``mamba_rms_norm``, ``out_proj`` (weight and bias times
    ``out_scale``); biases as the config says."""
    c = config
    out_bias = c.mamba_proj_bias if c.mamba_out_proj_bias is None else c.mamba_out_proj_bias
    specs = [
        *scaled_linear(f"{target}.in_proj", [f"{source}.in_proj"], (in_scale,),
                       (in_bias_scale,) if c.mamba_proj_bias else None),
        WeightSpec(f"{target}.conv_weight", (f"{source}.conv1d.weight",), squeeze_conv),
        WeightSpec(f"{target}.dt_bias", (f"{source}.dt_bias",)),
        WeightSpec(f"{target}.A_log", (f"{source}.A_log",)),
        WeightSpec(f"{target}.D", (f"{source}.D",)),
        *scaled_linear(f"{target}.out_proj", [f"{source}.out_proj"], (out_scale,), (out_scale,) if out_bias else None),
    ]
    if c.mamba_conv_bias:
        specs.append(WeightSpec(f"{target}.conv_bias", (f"{source}.conv1d.bias",)))
    if c.mamba_rms_norm:
        specs.append(norm_spec(f"{target}.norm.weight", f"{source}.norm.weight"))
    return specs


def mlp_specs(target: str, source: str, bias: bool = False, in_proj: Sequence[str] = ("gate_proj", "up_proj"),
              out_proj: str = "down_proj", in_scales: Sequence[Scale] | None = None,
              out_scale: float = 1.0) -> list[WeightSpec]:
    """:class:`MLP` (or a shared expert) from HF's projections: ``in_proj`` stacks the rows of the
    ``in_proj`` sources (SwiGLU: gate then up; relu²: up), each times its ``in_scales`` entry;
    ``out_proj`` is ``out_proj`` times ``out_scale``; weights and, with ``bias``, biases alike."""
    ins = [f"{source}.{p}" for p in in_proj]
    scales = tuple(in_scales) if in_scales is not None else (1.0,) * len(ins)
    return [
        *scaled_linear(f"{target}.in_proj", ins, scales, scales if bias else None),
        *scaled_linear(f"{target}.out_proj", [f"{source}.{out_proj}"], (out_scale,), (out_scale,) if bias else None),
    ]
