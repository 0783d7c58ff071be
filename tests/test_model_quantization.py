"""FP8 checkpoints (``hyla/model/quantization.py``): float8 weights with block-wise or per-tensor
scales, read back dequantized.

* An FP8 checkpoint loads as exactly the unquantized checkpoint of its dequantized values, for every
  architecture (MTP heads and fused expert tensors too), blocks that divide the shapes or not.
* Its logits are transformers' for the same files (``FineGrainedFP8Config``'s dequantization).
  transformers derives the block from the scale grid, which is wrong when a dim is no multiple of
  the block (Kimi's ``kv_a_proj_with_mqa``, 96 rows at block 64): hyla reads ``weight_block_size``,
  as DeepSeek's reference, vLLM and SGLang do (the last block partial), so that comparison takes a
  block that divides.
* Engines serve FP8 checkpoints as the dequantized ones (MTP drafting too), and weight updates read
  them; broken FP8 checkpoints are ``ValueError``s naming the tensor.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints
from hyla import Engine
from hyla.model.loader import load_model
from hyla.model.quantization import FP8_MAX, Fp8Scheme

IDS = list(range(5, 45))


def _same_weights(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert a.mtp_weights.keys() == b.mtp_weights.keys()
    for name in a.mtp_weights:
        assert torch.equal(a.mtp_weights[name], b.mtp_weights[name]), name


@pytest.mark.parametrize("block", [(128, 128), (64, 64), (48, 80), (1, 32), None])
def test_quantize_then_dequantize_is_within_fp8_rounding(block):
    """Every block's largest magnitude maps to FP8_MAX; the values come back within e4m3's rounding
    (3 mantissa bits: half an ulp, 1/16 of a value, or the subnormal step below 2^-6 of the scale)."""
    scheme = Fp8Scheme(block)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 136, generator=gen) * torch.logspace(-3, 1, 136)  # columns of very different sizes
    q, scale = scheme.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert tuple(scale.shape) == scheme.scale_shape(w.shape)
    back = scheme.dequantize(q, scale)
    full_scale = scheme.dequantize(torch.ones_like(q.float()).to(torch.float8_e4m3fn), scale)  # scale per element
    assert ((back - w).abs() <= w.abs() / 16 + full_scale * 2.0 ** -9 + 1e-30).all()
    if block is not None:  # each block reaches the top of the range
        br, bc = block
        assert q[0, :br, :bc].float().abs().max() == FP8_MAX


def test_scale_shapes():
    scheme = Fp8Scheme((128, 128))
    assert scheme.scale_shape((2048, 300)) == (16, 3)
    assert scheme.scale_shape((8, 96, 256)) == (8, 1, 2)
    assert Fp8Scheme(None).scale_shape((5, 5)) == ()
    assert Fp8Scheme(None).scale_fits((5, 5), (1,))
    with pytest.raises(ValueError, match="do not fit"):
        scheme.dequantize(torch.zeros(256, 256).to(torch.float8_e4m3fn), torch.ones(2, 3))


@pytest.mark.parametrize("cfg, match", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "two positive integers"),
    ("fp8", "must be an object"),
])
def test_unsupported_quantization_configs(cfg, match):
    with pytest.raises(ValueError, match=match):
        Fp8Scheme.from_hf({"quantization_config": cfg})
    assert Fp8Scheme.from_hf({}) is None
    assert Fp8Scheme.from_hf({"text_config": {"quantization_config": {"quant_method": "fp8"}}}) == Fp8Scheme(None)
    assert Fp8Scheme.from_hf({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}) \
        == Fp8Scheme((128, 64))


ARCHITECTURES = ["qwen3_next_moe_mtp_path", "qwen3_5_mtp_path", "qwen3_5_moe_path", "nemotron_h_path",
                 "falcon_h1_path", "bamba_path", "granite_h_path", "lfm2_moe_path", "kimi_linear_path",
                 "bailing_hybrid_path", "olmo_hybrid_path", "lara_mini_path", "lfm3_path", "zamba2_path",
                 "jamba_path", "mamba_path", "mamba2_path"]


@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_an_fp8_checkpoint_loads_as_its_dequantized_values(fixture, request):
    """Block-wise scales that do not divide most shapes (48 x 80): every parameter (µP factors folded
    after the dequantization, experts stacked, projections fused) and every MTP tensor is exactly
    what the unquantized checkpoint of the same values gives."""
    path = request.getfixturevalue(fixture)
    fp8 = checkpoints.quantize_checkpoint(path, block=(48, 80))
    reference = checkpoints.quantize_checkpoint(path, block=(48, 80), dequantized=True)
    assert any(k.endswith("_scale_inv") for k in load_file(fp8 / "model.safetensors"))
    _same_weights(load_model(fp8), load_model(reference))


def test_per_tensor_scales_and_input_scales(qwen3_next_moe_path):
    """vLLM's per-tensor FP8 (no ``weight_block_size``): one ``weight_scale`` per weight, an
    ``input_scale`` per layer (a static activation scale, unused by weight-only dequantization)."""
    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_path, block=None)
    names = load_file(fp8 / "model.safetensors").keys()
    assert any(k.endswith(".weight_scale") for k in names) and any(k.endswith(".input_scale") for k in names)
    _same_weights(load_model(fp8), load_model(checkpoints.quantize_checkpoint(qwen3_next_moe_path, block=None,
                                                                              dequantized=True)))


@pytest.mark.parametrize("fixture, block", [("qwen3_next_moe_path", (64, 64)), ("qwen3_5_moe_path", (32, 128)),
                                            ("jamba_path", (128, 32)), ("kimi_linear_path", (32, 32))])
def test_fp8_logits_match_transformers(fixture, block, request):
    """The same FP8 files through transformers (dequantized: no GPU) and hyla: fp32 logits within
    1e-4 over a 40-token prompt. Blocks that are not square (a swapped block would fail), and
    divide the shapes (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    fp8 = checkpoints.quantize_checkpoint(request.getfixturevalue(fixture), block=block)
    hf = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    runner = checkpoints.TinyRunner(load_model(fp8))
    got = runner.step([runner.new_seq()], [IDS], all_logits=True)
    assert (got - want).abs().max() < 1e-4


def _greedy(n: int) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


PROMPTS = [IDS, list(range(100, 170)), [7, 8, 9]]


def test_engine_serves_an_fp8_checkpoint_with_its_mtp_head(qwen3_5_mtp_path):
    """An engine on an FP8 checkpoint drafting with its (FP8) MTP head gives what an engine on the
    dequantized checkpoint gives: the same tokens, the same verify steps."""
    opts = dict(max_total_tokens=600, max_state_slots=16, speculative_algorithm="mtp", speculative_num_steps=3)
    results = []
    for path in (checkpoints.quantize_checkpoint(qwen3_5_mtp_path),
                 checkpoints.quantize_checkpoint(qwen3_5_mtp_path, dequantized=True)):
        with Engine(path, **opts) as engine:
            results.append(engine.generate(input_ids=PROMPTS, sampling_params=_greedy(24)))
            assert ("from an FP8 checkpoint, scales per 64x64 block" in engine.summary()) == (len(results) == 1)
    fp8, reference = results
    assert [o["output_ids"] for o in fp8] == [o["output_ids"] for o in reference]
    assert [o["meta_info"]["spec_verify_ct"] for o in fp8] == [o["meta_info"]["spec_verify_ct"] for o in reference]


def test_weight_update_from_an_fp8_checkpoint(qwen3_next_moe_path):
    """An engine serving the unquantized checkpoint, updated from the FP8 one, serves what an engine
    started on the FP8 one serves."""
    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_path)
    with Engine(fp8, max_total_tokens=600) as fresh:
        want = fresh.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
    with Engine(qwen3_next_moe_path, max_total_tokens=600) as engine:
        engine.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
        engine.update_weights_from_disk(fp8)
        got = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
        _same_weights(engine.model, load_model(fp8))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def _edited(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


Q = "model.layers.3.self_attn.q_proj.weight"


def test_broken_fp8_checkpoints_are_named(qwen3_next_moe_path, tmp_path):
    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_path)
    cases = [
        # float8 tensors without quantization_config: the missing config is named
        (dict(edit_config=lambda c: c.pop("quantization_config")), r"holds FP8 scales \(model.*_scale_inv.*no quantization_config"),
        # ... and float8 tensors without scales nor quantization_config
        (dict(edit_config=lambda c: c.pop("quantization_config"),
              edit_tensors=lambda t: [t.pop(k) for k in list(t) if k.endswith("_scale_inv")]),
         r"in_proj_qkvz.weight' is F8_E4M3.*its scales.*has not"),
        # a quantized tensor's scales missing
        (dict(edit_tensors=lambda t: t.pop(Q + "_scale_inv")), rf"{Q}' is F8_E4M3.*needs its scales \({Q}_scale_inv"),
        # scales of the wrong shape
        (dict(edit_tensors=lambda t: t.update({Q + "_scale_inv": torch.ones(3, 3)})), r"\(3, 3\) do not fit .*\(512, 256\) \(expected \(8, 4\)"),
        # scales beside a tensor that is not float8
        (dict(edit_tensors=lambda t: t.update({Q: t[Q].float()})), rf"{Q}' has scales.*but is F32"),
        # scales of no tensor: unexpected
        (dict(edit_tensors=lambda t: t.update({"model.layers.3.self_attn.x_proj.weight_scale_inv": torch.ones(1)})),
         r"does not use: .*x_proj\.weight_scale_inv"),
        # another quantization
        (dict(edit_config=lambda c: c.update(quantization_config={"quant_method": "gptq"})), "'gptq' is not supported"),
    ]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_model(_edited(fp8, tmp_path / str(i), **edit))
