"""Qwen3.5's vision tower, and where its image tokens sit in the text model's multimodal RoPE.

An image reaches the model as patches (``image_processing.py``: ``pixel_values [P, C * Tp * p * p]``
in 2x2 merge blocks, its grid ``(t, h, w)`` in patches). The tower (transformers'
``Qwen3_5VisionModel``) embeds each patch (a linear map: HF's ``Conv3d`` with its stride equal to
its kernel), adds a learned position table resampled to the grid (bilinear, corners aligned), runs
``depth`` pre-norm ViT blocks (LayerNorm, full attention within the image with a 2D rotary on
(row, column), a GELU MLP) and merges each 2x2 block of patches into one token of the text model's
width (``merger``): ``t * h * w / 4`` embeddings, which replace the prompt's image placeholder
tokens, one each, in order.

The text model's RoPE is multimodal (``mrope_section``, interleaved): each rotary frequency reads
one of three position components, temporal, height or width. A text token has all three equal; an
image token's are its frame, row and column, offset by the position where the image starts; the
text after an image continues from the largest position in it plus one (:func:`image_positions`).
So a prompt's positions run behind its token count by a *rope delta* after each image, which every
later token (a decode step's too) adds to its index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn



@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen3.5 (or Qwen3.5-MoE) vision-language checkpoint (``vision_config``),
    with the token ids the prompt marks images with and the text RoPE's ``mrope_section``."""

    depth: int = 27  # (transformers' Qwen3_5VisionConfig defaults throughout)
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 3584  # the text model's hidden size
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "in_channels", "num_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} must split into num_heads "
                             f"{self.num_heads} heads of a size divisible by 4 (the 2D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings must be a square, got {self.num_position_embeddings}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ValueError(f"mrope_section must be three sizes, got {self.mrope_section}")

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], text_hidden_size: int) -> "VisionConfig | None":
        """The tower a vision-language ``config.json`` describes (None when it has no ``vision_config``:
        then hyla serves the text model alone). ``ValueError`` for a malformed one, or a tower whose
        output is not ``text_hidden_size`` wide."""
        vision = cfg.get("vision_config")
        if vision is None:
            return None
        if not isinstance(vision, Mapping):
            raise ValueError("vision_config must be an object")
        text = cfg.get("text_config") or {}
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        vision_rope = dict(vision.get("rope_parameters") or {})
        kw: dict[str, Any] = {}
        for key in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                    "temporal_patch_size", "spatial_merge_size", "in_channels", "num_position_embeddings",
                    "hidden_act"):
            if vision.get(key) is not None:
                kw[key] = vision[key]
        for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            if cfg.get(key) is not None:
                kw[key] = int(cfg[key])
        if rope.get("mrope_section") is not None:
            kw["mrope_section"] = tuple(int(s) for s in rope["mrope_section"])
        kw["rope_theta"] = float(vision_rope.get("rope_theta", 10000.0))
        config = cls(**kw)
        if config.out_hidden_size != text_hidden_size:
            raise ValueError(f"vision_config.out_hidden_size ({config.out_hidden_size}) must be the text model's "
                             f"hidden_size ({text_hidden_size})")
        return config

    @property
    def patch_dim(self) -> int:
        """The values of one patch: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class VisionBlock(nn.Module):
    """``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; attention is bidirectional within each image."""

    def __init__(self, c: VisionConfig, dtype: torch.dtype):
        super().__init__()
        d, self.num_heads = c.hidden_size, c.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-6, dtype=dtype)
        self.norm2 = nn.LayerNorm(d, eps=1e-6, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.proj = nn.Linear(d, d, dtype=dtype)
        self.fc1 = nn.Linear(d, c.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(c.intermediate_size, d, dtype=dtype)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, h, -1).unbind(1)  # [N, H, Dh] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, H, n_i, Dh] per image: 4-D, so that the CPU's flash kernel runs it (3-D falls to the math path: 3x)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in qkv))[0]
               for qkv in zip(q.split(lengths), k.split(lengths), v.split(lengths))]  # [H, n_i, Dh]
        x = x + self.proj(torch.cat([o.transpose(0, 1) for o in out]).reshape(n, -1))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [N, H, Dh]`` in fp32 (as transformers' vision rotary), back in its dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionTower(nn.Module):
    """Patches ``[P, patch_dim]`` of one or more images -> their text-width embeddings ``[P / merge**2,
    out_hidden_size]`` (:meth:`forward`)."""

    def __init__(self, c: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.config = c
        self.patch_embed = nn.Linear(c.patch_dim, c.hidden_size, dtype=dtype)  # HF's Conv3d, flattened
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size, dtype=dtype,
                                      _weight=torch.empty(c.num_position_embeddings, c.hidden_size, dtype=dtype))
        self.blocks = nn.ModuleList([VisionBlock(c, dtype) for _ in range(c.depth)])
        merged = c.hidden_size * c.spatial_merge_size ** 2
        self.merger_norm = nn.LayerNorm(c.hidden_size, eps=1e-6, dtype=dtype)
        self.merger_fc1 = nn.Linear(merged, merged, dtype=dtype)
        self.merger_fc2 = nn.Linear(merged, c.out_hidden_size, dtype=dtype)
        head_dim = c.hidden_size // c.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``pixel_values [sum t*h*w, patch_dim]``: the images' patches one after another, each in its
        merge-block order; ``grids``: each image's ``(t, h, w)`` in patches. Returns ``[sum t*h*w / m**2,
        out_hidden_size]`` in the model dtype. ``ValueError`` when the patches do not fit the grids."""
        c = self.config
        m = c.spatial_merge_size
        if any(min(g) <= 0 or g[1] % m or g[2] % m for g in grids):
            raise ValueError(f"image grids {grids} must be positive, their height and width multiples of {m}")
        total = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (total, c.patch_dim):
            raise ValueError(f"pixel_values must be [{total}, {c.patch_dim}] for grids {grids}, "
                             f"got {list(pixel_values.shape)}")
        dev, dtype = self.patch_embed.weight.device, self.patch_embed.weight.dtype
        x = self.patch_embed(pixel_values.to(dev, dtype))  # [P, D]
        x = x + torch.cat([self._positions(t, h, w) for t, h, w in grids])
        rows, cols = zip(*(_block_order(t, h, w, m) for t, h, w in grids))
        freqs = torch.cat([torch.cat(rows).to(dev)[:, None] * self.inv_freq,
                           torch.cat(cols).to(dev)[:, None] * self.inv_freq], dim=-1)  # [P, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
        cos, sin = emb.cos(), emb.sin()
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # attention within each frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.merger_norm(x).view(-1, c.hidden_size * m * m)  # [P / m**2, D * m**2]
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position table (a ``side x side`` grid) resampled to ``h x w`` (bilinear, corners
        aligned) in merge-block order, repeated for each of the ``t`` frames: ``[t*h*w, D]``."""
        c, m = self.config, self.config.spatial_merge_size
        side = math.isqrt(c.num_position_embeddings)
        table = self.pos_embed.weight.float().T.reshape(1, c.hidden_size, side, side)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
        grid = grid.reshape(c.hidden_size, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, c.hidden_size)
        return grid.to(self.pos_embed.weight.dtype).repeat(t, 1)


def _block_order(t: int, h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in merge-block order (the order of the patches), ``t`` times."""
    rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m).reshape(-1)
    cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m).reshape(-1)
    return rows.repeat(t).float(), cols.repeat(t).float()


# ------------------------------------------------------------------------------------------------
# The multimodal RoPE's positions
# ------------------------------------------------------------------------------------------------
def image_positions(start: int, grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, int]:
    """The (temporal, height, width) positions ``[3, t * h/m * w/m]`` of an image's tokens that begin at
    position ``start`` (transformers' ``get_vision_position_ids``: frame, row and column of each merged
    token, each plus ``start``), and the position of the token after the image: ``start + max(h, w) / m``
    (as transformers' ``get_rope_index`` advances; the frames of an image are one, ``t`` = 1)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt = torch.arange(t).view(t, 1, 1).expand(t, h, w).reshape(-1)
    hh = torch.arange(h).view(1, h, 1).expand(t, h, w).reshape(-1)
    ww = torch.arange(w).view(1, 1, w).expand(t, h, w).reshape(-1)
    return torch.stack([tt, hh, ww]) + start, start + max(h, w)


def mrope_frequency_axes(section: tuple[int, int, int], num_freqs: int) -> torch.Tensor:
    """Which position component each of the ``num_freqs`` rotary frequencies reads, interleaved as
    transformers' ``Qwen3_5TextRotaryEmbedding``: frequency ``j`` reads height when ``j % 3 == 1`` and
    ``j < 3 * section[1]``, width when ``j % 3 == 2`` and ``j < 3 * section[2]``, else time. ``[num_freqs]``."""
    axes = torch.zeros(num_freqs, dtype=torch.long)
    for axis in (1, 2):
        axes[axis:min(3 * section[axis], num_freqs):3] = axis
    return axes
