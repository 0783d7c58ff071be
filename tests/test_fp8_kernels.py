"""The weight-only FP8 projections (``gemv.linear``, ``gemv.expert_linear``, ``moe.expert_gemm`` and
``fp8.linear`` on float8_e4m3fn weights with fp32 block scales) against their reference,
``F.linear(x, Fp8Scheme(block).dequantize(w, scale).to(x.dtype))``: the weight dequantized and
rounded to x's dtype, then fp32 sums rounded once.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before any kernel is defined, as in ``test_fused_decode``). There a cast from fp32 to bf16 truncates
(a GPU rounds to nearest, as PyTorch does), so the reference rounds the dequantized weight the way the
kernels do where they run (:func:`_rounded`), and bf16 outputs are compared within a rounding step.
The scales are spread over 2**-4..2**4, so that a scale read from another block gives another result.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before hyla.model.ops.gpu defines its kernels
DEVICE = "cuda" if GPU else "cpu"

pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hyla.model.ops.gpu import fp8, gemv, moe  # noqa: E402
from hyla.model.quantization import Fp8Scheme  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
N, K = 200, 136  # neither a multiple of 128 (nor of 48, 80): partial blocks at both ends
# DeepSeek's and Qwen's; one whose K the GEMMs' tiles divide, not square (a scale read along the wrong dim
# shows); an odd one; one scale for the whole weight
BLOCKS = [(128, 128), (64, 128), (48, 80), (N, K)]


@pytest.fixture(autouse=True)
def interpreted_bf16_dot(monkeypatch):
    """Triton's interpreter (3.9) holds bf16 tensors as their uint16 bits and ``tl.dot`` multiplies
    those bits as integers; widened to fp32 first (exact) its dot is a GPU's bf16 MMA's: exact
    products, fp32 sums. The GEMMs (``moe.expert_gemm``, ``fp8.linear``'s) dot bf16 tiles."""
    if GPU:
        return
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _quantized(g: torch.Generator, *shape: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A random float8 weight of ``shape`` and its fp32 scales in blocks of ``block``, spread 2**-4..2**4."""
    q, s = Fp8Scheme(block).quantize(torch.randn(*shape, generator=g))
    s = s * 2.0 ** torch.randint(-4, 5, s.shape, generator=g)
    return q.to(DEVICE), s.to(DEVICE)


def _rounded(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight rounded to ``dtype`` as the kernels round it, in fp32: to nearest on a
    GPU (PyTorch's ``.to``), interpreted bf16 by truncation."""
    w = Fp8Scheme(block).dequantize(q, s)
    if dtype == torch.bfloat16 and not GPU:
        return (w.view(torch.int32) & -65536).view(torch.float32)
    return w.to(dtype).float()


def _assert_matches(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> None:
    """``y`` (``[M, N]`` in ``dtype``) == ``x [M, K] @ w.T (+ bias)`` summed in fp32 over ``w``, the
    weight as :func:`_rounded`: fp32 within 1e-5 of each output, bf16 within a rounding step of it
    (two with a bias: the sum rounded, then the add), both besides fp32 sums in another order
    (1e-6 of ``|x| @ |w|.T``)."""
    exact = F.linear(x.float(), w)
    order = 1e-6 * F.linear(x.float().abs(), w.abs())
    step = 1e-5 if dtype == torch.float32 else 2**-7
    tol = step * exact.abs() + order
    if bias is not None:
        exact = exact + bias.float()
        tol = tol + step * exact.abs()
    assert y.shape == exact.shape and y.dtype == dtype
    err = (y.float() - exact).abs()
    assert (err <= tol).all(), f"{int((err > tol).sum())} of {err.numel()} outputs off, worst {float(err.max())}"


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_fp8(dtype, block):
    """``gemv.linear`` on an FP8 weight: each program's slice dequantized with its blocks' scales, for
    one row and a few; row-major, and column-major with its scales so too (as CPU weights load)."""
    g = torch.Generator().manual_seed(0)
    q, s = _quantized(g, N, K, block=block)
    w = _rounded(q, s, block, dtype)
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=g).to(DEVICE, dtype)
        for qq, ss in ((q, s), (q.t().contiguous().t(), s.t().contiguous().t())):
            _assert_matches(gemv.linear(x, qq, ss, block), x, w, dtype)
    assert gemv.linear_fits(q) and not gemv.linear_fits(q.new_empty(4, gemv.LINEAR_TILE[0]))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_linear_fp8(dtype, block):
    """``gemv.expert_linear`` on stacked FP8 experts: each assignment through its expert's weight and
    scales, repeated and unused experts, int32 ids, assignments reading their token's row (``per_row``)."""
    g = torch.Generator().manual_seed(1)
    q, s = _quantized(g, 4, N, K, block=block)
    w = _rounded(q, s, block, dtype)
    x = torch.randn(5, K, generator=g).to(DEVICE, dtype)
    ids = [3, 0, 3, 1, 3]
    for per_row, tokens in ((1, x), (2, x[:3])):  # per_row 2: 3 tokens' 2 assignments each
        experts = torch.tensor(ids + [0] if per_row == 2 else ids, device=DEVICE)
        y = gemv.expert_linear(tokens, q, experts.int(), per_row, s, block)
        for a, e in enumerate(experts.tolist()):
            _assert_matches(y[a:a + 1], tokens[a // per_row:a // per_row + 1], w[e], dtype)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_gemm_fp8(dtype, block):
    """``moe.expert_gemm`` on stacked FP8 experts through ``moe.plan``: the in projection (each pair
    reads its token) and the out projection over the transposed weights, their scales transposed and
    the block swapped (each pair its own row). The default tiles' BLOCK_K (64) divides blocks 128 and 64
    wide: one scale per column of a tile; 80, 48 and 200 or 136 do not: each element's own."""
    g = torch.Generator().manual_seed(2)
    e, t, k = 4, 5, 2
    q, s = _quantized(g, e, N, K, block=block)
    w = _rounded(q, s, block, dtype)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    p = moe.plan(experts, e)
    flat = experts.flatten().tolist()
    x = torch.randn(t, K, generator=g).to(DEVICE, dtype)
    h = moe.expert_gemm(x, q, p, k, s, block)  # [A, N]
    for a, j in enumerate(flat):
        _assert_matches(h[a:a + 1], x[a // k:a // k + 1], w[j], dtype)
    y = moe.expert_gemm(h, q.transpose(1, 2), p, 1, s.transpose(1, 2), block[::-1])  # [A, K]
    for a, j in enumerate(flat):
        _assert_matches(y[a:a + 1], h[a:a + 1], w[j].t(), dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear(dtype, block, bias, monkeypatch):
    """``fp8.linear``: a few rows through ``gemv.linear`` (1, 3), more through the tiled GEMM (40),
    and a K past the GEMV's through the GEMM at 2 rows; the bias added after, in x's dtype."""
    g = torch.Generator().manual_seed(3)
    q, s = _quantized(g, N, K, block=block)
    w = _rounded(q, s, block, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    gemvs = []
    monkeypatch.setattr(gemv, "linear", lambda *args, run=gemv.linear: gemvs.append(args[0].shape[0]) or run(*args))
    for rows in (1, 3, 40):
        x = torch.randn(rows, K, generator=g).to(DEVICE, dtype)
        _assert_matches(fp8.linear(x, q, s, block, b), x, w, dtype, b)
    assert gemvs == [1, 3] and fp8.GEMV_ROWS < 40
    long_k = gemv.LINEAR_TILE[0] // 2 + 40  # past linear_fits, not a whole number of tiles
    q, s = _quantized(g, 24, long_k, block=(16, 128))
    x = torch.randn(2, long_k, generator=g).to(DEVICE, dtype)
    _assert_matches(fp8.linear(x, q, s, (16, 128)), x, _rounded(q, s, (16, 128), dtype), dtype)
    assert gemvs == [1, 3]
    assert fp8.linear(x[:0], q, s, (16, 128)).shape == (0, 24)


def test_fp8_arguments_refused():
    """An FP8 weight without its scale or block, scales that do not fit the block grid (the grid
    transposed, one block short, bf16), a bad block, scales with a weight in x's dtype: ValueErrors,
    from each kernel's wrapper."""
    g = torch.Generator().manual_seed(4)
    block = (48, 80)
    q, s = _quantized(g, N, K, block=block)
    qe, se = _quantized(g, 2, N, K, block=block)
    x = torch.randn(2, K, generator=g).to(DEVICE)
    ids = torch.tensor([1, 0], device=DEVICE)
    p = moe.plan(ids[:, None], 2)
    calls = [lambda sc, bl: gemv.linear(x, q, sc, bl), lambda sc, bl: fp8.linear(x, q, sc, bl),
             lambda sc, bl: gemv.expert_linear(x, qe, ids, 1, sc if sc is None else sc.expand(2, *sc.shape), bl),
             lambda sc, bl: moe.expert_gemm(x, qe, p, 1, sc if sc is None else sc.expand(2, *sc.shape), bl)]
    for call in calls:
        with pytest.raises(ValueError, match="needs its scale and block"):
            call(None, block)
        with pytest.raises(ValueError, match="needs its scale and block"):
            call(s, None)
        for bad in (s.t(), s[:-1], s.bfloat16()):
            with pytest.raises(ValueError, match="the scale of a"):
                call(bad, block)
        for bad in ((0, 80), (48,), (48.0, 80)):
            with pytest.raises(ValueError, match="block must be"):
                call(s, bad)
    with pytest.raises(ValueError, match="go with a float8_e4m3fn weight"):
        gemv.linear(x, torch.randn(N, K, generator=g).to(DEVICE), s, block)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.linear(x, torch.randn(N, K, generator=g).to(DEVICE), s, block)
    with pytest.raises(ValueError, match="bias"):
        fp8.linear(x, q, s, block, torch.zeros(N, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x's dtype"):
        gemv.linear(x.double(), q, s, block)
