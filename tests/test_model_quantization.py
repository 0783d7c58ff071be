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
from hyla.model.linear import Linear
from hyla.model.loader import load_model
from hyla.model.quantization import FP8, FP8_MAX, Fp8Scheme, dequantized, is_fp8

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


@pytest.fixture(scope="module")
def qwen3_next_bias_path(tiny_ckpt_dir):
    """The tiny Qwen3-Next MoE with biases in its attention projections (a kept Linear with a bias)."""
    return checkpoints.make_qwen3_next(tiny_ckpt_dir, moe=True, attention_bias=True)


ARCHITECTURES = ["qwen3_next_moe_mtp_path", "qwen3_next_bias_path", "qwen3_5_mtp_path", "qwen3_5_moe_path", "nemotron_h_path",
                 "falcon_h1_path", "bamba_path", "granite_h_path", "lfm2_moe_path", "kimi_linear_path",
                 "bailing_hybrid_path", "olmo_hybrid_path", "lara_mini_path", "lfm3_path", "zamba2_path",
                 "jamba_path", "minimax_path", "mamba_path", "mamba2_path"]


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


@pytest.mark.parametrize("fp8_weights", ["auto", "keep"])
def test_engine_serves_an_fp8_checkpoint_with_its_mtp_head(qwen3_5_mtp_path, fp8_weights):
    """An engine on an FP8 checkpoint drafting with its (FP8) MTP head gives what an engine on the
    dequantized checkpoint gives: dequantized at load (auto, on the CPU) the same tokens and verify
    steps; the weights kept in float8 (the model's and the head's) the same greedy tokens and logprobs
    within 1e-4 up to each first tie. The head holds its weights alone: the model keeps no mtp.* copy."""
    from test_engine_differential import compare_outputs

    opts = dict(max_total_tokens=600, max_state_slots=16, speculative_algorithm="mtp", speculative_num_steps=3)
    results = []
    for path in (checkpoints.quantize_checkpoint(qwen3_5_mtp_path),
                 checkpoints.quantize_checkpoint(qwen3_5_mtp_path, dequantized=True)):
        with Engine(path, fp8_weights=fp8_weights, **opts) as engine:
            results.append(engine.generate(input_ids=PROMPTS, sampling_params=_greedy(24), return_logprob=True))
            assert ("from an FP8 checkpoint, scales per 64x64 block" in engine.summary()) == (len(results) == 1)
            assert engine.keeps_fp8 == (fp8_weights == "keep")
            head = engine.mtp_head
            assert head.fc.weight.dtype == (FP8 if engine.keeps_fp8 and len(results) == 1 else torch.float32)
            assert engine.model.mtp_weights == {} and engine.model.mtp_scales == {}
    fp8, reference = results
    assert compare_outputs(fp8, reference) > 0.9 * 24 * len(PROMPTS)
    if fp8_weights == "auto":
        assert [o["output_ids"] for o in fp8] == [o["output_ids"] for o in reference]
        assert [o["meta_info"]["spec_verify_ct"] for o in fp8] == \
            [o["meta_info"]["spec_verify_ct"] for o in reference]


def test_mtp_head_keeps_fp8_weights(qwen3_next_moe_mtp_path):
    """load_model(keep_fp8=True) keeps an FP8 checkpoint's quantized mtp.* tensors float8 as stored, with their
    scales (model.mtp_scales), and the MTP head built from them keeps its projections and experts so: each the
    head of the dequantized checkpoint's value, exactly, once dequantized; the norms and the rest in the model's
    dtype. Without mtp (an engine that drafts with no MTP head) the model reads no mtp.* tensor."""
    from hyla.model.mtp import MtpHead

    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_mtp_path)
    model = load_model(fp8, keep_fp8=True)
    assert model.mtp_scales and all(model.mtp_weights[n].dtype == FP8 for n in model.mtp_scales)
    head = MtpHead.from_model(model)
    dense = MtpHead.from_model(load_model(checkpoints.quantize_checkpoint(qwen3_next_moe_mtp_path, dequantized=True)))
    kept = {name for name, p in head.named_parameters() if is_fp8(p)}
    assert {"fc.weight", "layer.mixer.qkv_proj.weight", "layer.mixer.o_proj.weight", "layer.ffn.w_in",
            "layer.ffn.w_out", "layer.ffn.shared_expert.in_proj.weight"} <= kept
    for name, p in dense.named_parameters():
        got = dict(head.named_parameters())[name]
        if name in kept:
            module, _, param = name.rpartition(".")
            scale, block = (getattr(head.get_submodule(module), f"{param}_{what}") for what in ("scale", "block"))
            got = dequantized(got, scale, block, torch.float32)
        assert torch.equal(got, p), name
    assert head.norm.weight.dtype == head.layer.ffn.router.weight.dtype == torch.float32
    # a head built without take shares nothing with the model's kept tensors (a weight update writes it in place)
    storages = {t.untyped_storage().data_ptr() for t in [*model.mtp_weights.values(),
                                                          *(s for s, _ in model.mtp_scales.values())]}
    assert not storages & {t.untyped_storage().data_ptr() for t in head.state_dict().values()}
    taken = MtpHead.from_model(model, take=True)  # the head takes the weights: one copy of them, none made
    assert model.mtp_weights == {} and model.mtp_scales == {} and is_fp8(taken.fc.weight)
    assert {"fc.weight", "fc.weight_scale"} <= {n for n, t in taken.state_dict().items()
                                                if t.untyped_storage().data_ptr() in storages}
    with pytest.raises(ValueError, match="this model has no mtp.* tensors: .* a head took them"):
        MtpHead.from_model(model)
    assert load_model(fp8, keep_fp8=True, mtp=False).mtp_weights == {}


def test_kept_fp8_weights_hold_none_of_the_files_memory(qwen3_next_moe_mtp_path, tmp_path):
    """A model loaded with keep_fp8 and its MTP head hold their weights and scales in memory of their own: a
    trainer overwriting the checkpoint in place afterwards changes none of them (the scales were the file's
    memory-mapped bytes on the CPU)."""
    import shutil

    from hyla.model.mtp import MtpHead

    path = shutil.copytree(checkpoints.quantize_checkpoint(qwen3_next_moe_mtp_path), tmp_path / "fp8")
    model = load_model(path, keep_fp8=True)
    head = MtpHead.from_model(model, take=True)
    before = {f"{who}.{n}": t.clone() for who, m in (("model", model), ("head", head)) for n, t in m.state_dict().items()}
    assert any(n.endswith("_scale") for n in before)
    for shard in path.glob("*.safetensors"):  # the data after the header, overwritten in place (the same inode)
        header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        with open(shard, "r+b") as f:
            f.seek(header)
            f.write(b"\x7f" * (shard.stat().st_size - header))
    after = {f"{who}.{n}": t for who, m in (("model", model), ("head", head)) for n, t in m.state_dict().items()}
    assert [n for n in before if not torch.equal(before[n], after[n])] == []


def test_minimax_lightning_qkv_stays_fp8(minimax_path):
    """MiniMax's lightning qkv_proj, regrouped from transformers' per-head [q_h | k_h | v_h] rows to [q | k | v]:
    float8 where each head's rows are whole blocks (32-row blocks, heads of 32), its scale rows moved alike, the
    dequantized checkpoint's value exactly; 64-row blocks split no head evenly: dequantized at load."""
    fp8 = checkpoints.quantize_checkpoint(minimax_path, block=(32, 128))
    qkv, dense = load_model(fp8, keep_fp8=True).layers[0].mixer.qkv_proj, load_model(fp8).layers[0].mixer.qkv_proj
    assert is_fp8(qkv.weight) and qkv.weight_block == (32, 128)
    assert torch.equal(dequantized(qkv.weight, qkv.weight_scale, qkv.weight_block, torch.float32), dense.weight)
    odd = load_model(checkpoints.quantize_checkpoint(minimax_path, block=(64, 64)), keep_fp8=True)
    assert odd.layers[0].mixer.qkv_proj.weight.dtype == torch.float32


def test_weight_update_of_a_kept_fp8_mtp_head(tiny_ckpt_dir):
    """An engine drafting with a float8 MTP head, updated from another FP8 checkpoint: the head's float8 weights
    and scales written in place as stored (not quantized again), the engine then serving what a fresh one does."""
    old = checkpoints.quantize_checkpoint(checkpoints.make_qwen3_5(tiny_ckpt_dir, mtp=True))
    new = checkpoints.quantize_checkpoint(checkpoints.make_qwen3_5(tiny_ckpt_dir, seed=1, mtp=True))
    opts = dict(max_total_tokens=600, fp8_weights="keep", speculative_algorithm="mtp", speculative_num_steps=2)
    with Engine(new, **opts) as fresh:
        want = fresh.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
    raw = load_file(new / "model.safetensors")
    with Engine(old, **opts) as engine:
        fc = engine.mtp_head.fc.weight
        engine.update_weights_from_disk(new)
        assert engine.mtp_head.fc.weight is fc and is_fp8(fc)
        assert torch.equal(fc.view(torch.uint8), raw["mtp.fc.weight"].view(torch.uint8))
        assert torch.equal(engine.mtp_head.fc.weight_scale, raw["mtp.fc.weight_scale_inv"])
        got = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


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
N = "model.layers.3.input_layernorm.weight"


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
        # a vector with block scales
        (dict(edit_tensors=lambda t: t.update({N: t[N].to(torch.float8_e4m3fn), N + "_scale_inv": torch.ones(1, 1)})),
         rf"{N}' of shape \(256,\) has block scales"),
        # scales that are not finite, or negative
        (dict(edit_tensors=lambda t: t[Q + "_scale_inv"].__setitem__((0, 0), float("nan"))), "_scale_inv' hold a"),
        (dict(edit_tensors=lambda t: t[Q + "_scale_inv"].__setitem__((0, 0), -1.0)), "_scale_inv' hold a negative"),
    ]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_model(_edited(fp8, tmp_path / str(i), **edit))


def test_mis_shaped_fp8_tensors_are_named_when_kept(qwen3_next_moe_path, tmp_path):
    """With ``keep_fp8``, a quantized tensor that does not make its parameter (q_proj narrower than
    k_proj and v_proj, stacked with them; a per-tensor one flattened) is the ``ValueError`` naming it
    that loading it dequantized gives, not torch's error from planning the float8 parameter."""
    block = Fp8Scheme((64, 64))

    def narrow(t):
        t[Q], t[Q + "_scale_inv"] = block.quantize(block.dequantize(t[Q], t[Q + "_scale_inv"])[:, :192])

    cases = [(checkpoints.quantize_checkpoint(qwen3_next_moe_path), narrow, rf"{Q} \(512, 192\), .* do not make"),
             (checkpoints.quantize_checkpoint(qwen3_next_moe_path, block=None), lambda t: t.update({Q: t[Q].flatten()}),
              rf"{Q} \(131072,\), .* do not make")]
    for i, (fp8, edit, match) in enumerate(cases):
        bad = _edited(fp8, tmp_path / str(i), edit_tensors=edit)
        for keep_fp8 in (False, True):
            with pytest.raises(ValueError, match=match):
                load_model(bad, keep_fp8=keep_fp8)


# --- weights kept in FP8 (load_model(keep_fp8=True), Engine(fp8_weights="keep")) ---------------------


def _fp8_share(model) -> float:
    params = list(model.parameters())
    return sum(p.numel() for p in params if is_fp8(p)) / sum(p.numel() for p in params)


@pytest.mark.parametrize("block", [(32, 128), None])  # (not square: a block read the wrong way round shows)
@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_kept_fp8_weights_compute_the_dequantized_model(fixture, block, request):
    """Projections and experts kept float8 with their scales (PyTorch's dequantization per step on
    the CPU): the logits of the model loaded dequantized, within fp32 rounding (another summation
    order). Every architecture keeps some weights so, but Falcon-H1, whose µP factors change every
    projection's values."""
    fp8 = checkpoints.quantize_checkpoint(request.getfixturevalue(fixture), block=block)
    kept = load_model(fp8, keep_fp8=True)
    assert _fp8_share(kept) > 0 or fixture == "falcon_h1_path"
    if fixture == "qwen3_next_bias_path":  # a float8 projection with a bias (o_proj; per block also qkv_proj)
        assert any(isinstance(m, Linear) and is_fp8(m.weight) and m.bias is not None for m in kept.modules())
    for name, p in kept.named_parameters():
        if is_fp8(p):
            module, _, param = name.rpartition(".")
            scale = getattr(kept.get_submodule(module), f"{param}_scale")
            block_ = getattr(kept.get_submodule(module), f"{param}_block")
            assert scale.dtype == torch.float32 and tuple(scale.shape) == Fp8Scheme(block_).scale_shape(p.shape)
    outs = []
    for model in (load_model(fp8), kept):
        runner = checkpoints.TinyRunner(model)
        outs.append(runner.step([runner.new_seq()], [IDS], all_logits=True))
    assert (outs[0] - outs[1]).abs().max() < 1e-4


def test_what_stays_fp8(qwen3_next_moe_path, qwen3_5_moe_path):
    """Qwen3-Next: the experts, the shared expert, attention's q/k/v (stacked by rows) and out
    projections, Gated DeltaNet's out projection and in projection (its rows regrouped per key head: the
    q, k, v and z rows whole blocks, moved with their scales' rows; b and a its tail); not the router,
    the norms, the embeddings, lm_head. Blocks that do not divide a stacked tensor's rows keep it
    dequantized; a lone tensor's last block may be partial."""
    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_path)
    model = load_model(fp8, keep_fp8=True)
    moe, attn, gdn = model.layers[3].ffn, model.layers[3].mixer, model.layers[0].mixer
    assert moe.w_in.dtype == moe.w_out.dtype == FP8 and moe.w_in_scale.shape == (8, 4, 4)
    assert moe.shared_expert.in_proj.weight.dtype == FP8 and attn.qkv_proj.weight.dtype == FP8
    assert attn.o_proj.weight.dtype == gdn.out_proj.weight.dtype == FP8
    assert moe.router.weight.dtype == model.lm_head.weight.dtype == torch.float32
    # [q | k | v | z] of 2 key heads (64 + 64 + 128 + 128 rows each, blocks of 64): 12 block rows, regrouped from the
    # checkpoint's per-head [q_h | k_h | v_h | z_h]; [b | a] (2 x 2 x 2 rows) the fp32 tail
    raw = load_file(fp8 / "model.safetensors")
    qkvz, scale = (raw[f"model.layers.0.linear_attn.in_proj_qkvz.weight{s}"] for s in ("", "_scale_inv"))
    assert gdn.in_proj.weight.dtype == FP8 and gdn.in_proj.weight_tail.shape == (8, 256)
    assert torch.equal(gdn.in_proj.weight[:64].view(torch.uint8), qkvz[:64].view(torch.uint8))  # head 0's q
    assert torch.equal(gdn.in_proj.weight[64:128].view(torch.uint8), qkvz[384:448].view(torch.uint8))  # head 1's q
    assert torch.equal(gdn.in_proj.weight_scale[1], scale[6]) and torch.equal(gdn.in_proj.weight_scale[2], scale[1])
    assert not gdn.in_proj.weight[768:].view(torch.uint8).any() and not gdn.in_proj.weight_scale[12:].any()
    dense = load_model(fp8)  # the same values, dequantized
    assert torch.equal(gdn.in_proj.weight_tail, dense.layers[0].mixer.in_proj.weight[768:])
    assert torch.equal(dequantized(gdn.in_proj.weight[:768], gdn.in_proj.weight_scale[:12], (64, 64), torch.float32),
                       dense.layers[0].mixer.in_proj.weight[:768])
    # 48-row blocks do not divide a key head's 64 q rows: dequantized
    odd = load_model(checkpoints.quantize_checkpoint(qwen3_next_moe_path, block=(48, 80)), keep_fp8=True)
    assert odd.layers[0].mixer.in_proj.weight.dtype == torch.float32
    # 48-row blocks: the experts' gate (128 rows) does not end on a block, so w_in is dequantized; w_out's
    # experts are one tensor each (256 rows: 6 blocks, the last partial) and stay float8
    model = load_model(checkpoints.quantize_checkpoint(qwen3_5_moe_path, block=(48, 80)), keep_fp8=True)
    moe = model.layers[3].ffn
    assert moe.w_in.dtype == torch.float32 and moe.w_out.dtype == FP8 and moe.w_out_scale.shape == (8, 6, 2)
    # Qwen3.5's Gated DeltaNet in projection [qkv | z | b | a] (512 + 256 + 4 + 4 rows): qkv and z float8, b and a
    # (no whole blocks) its tail, in the model's dtype
    proj = load_model(checkpoints.quantize_checkpoint(qwen3_5_moe_path), keep_fp8=True).layers[0].mixer.in_proj
    assert proj.weight.dtype == FP8 and proj.weight.shape == (776, 256) and proj.weight_tail.shape == (8, 256)
    assert proj.weight_tail.dtype == torch.float32 and not proj.weight_scale[12:].any()


OPTS = dict(max_total_tokens=360, max_state_slots=16, max_running_requests=10, chunked_prefill_size=64,
            debug_checks=True)


def test_engine_differential_kept_against_dequantized(qwen3_next_moe_path):
    """The cache differential workload (two waves of chats and shared prefixes, eviction and
    retraction) on an engine keeping the FP8 weights and one dequantizing them: the same greedy
    tokens and logprobs within 1e-4 up to each request's first tie, the same cache hits."""
    from test_engine_differential import assert_drained, compare_outputs, make_workload, run

    fp8 = checkpoints.quantize_checkpoint(qwen3_next_moe_path)
    wave1, _ = make_workload(11, 2048, num_sessions=12, num_shared=12, scale=0.5)
    outs = {}
    for mode in ("keep", "dequantize"):
        with Engine(fp8, fp8_weights=mode, **OPTS) as engine:
            outs[mode] = run(engine, wave1)
            assert_drained(engine)
            stats = engine.get_stats()
            assert ("kept in float8" in engine.summary()) == (mode == "keep")
        assert stats["num_evicted_tokens"] > 0
    assert compare_outputs(outs["keep"], outs["dequantize"]) > 0.9 * sum(s["max_new"] for s in wave1)
    assert [o["meta_info"]["cached_tokens"] for o in outs["keep"]] == \
        [o["meta_info"]["cached_tokens"] for o in outs["dequantize"]]


def _kept_scale(model, name: str) -> torch.Tensor:
    module, _, param = name.rpartition(".")
    return getattr(model.get_submodule(module), f"{param}_scale")


@pytest.mark.parametrize("make", [checkpoints.make_qwen3_next, checkpoints.make_qwen3_5])
def test_weight_update_of_kept_fp8_weights(make, tiny_ckpt_dir):
    """An engine keeping FP8 weights updates from another FP8 checkpoint of the model (the weights and
    their scales written in place as stored): it then serves what a fresh engine on it serves. From
    an unquantized checkpoint (a trainer's), or one quantized in other blocks, its float8 weights are
    quantized again in their own blocks, as ``quantize_fp8`` quantizes at load, and the others read
    as they are."""
    kw = {"moe": True} if make is checkpoints.make_qwen3_next else {}  # (Qwen3.5: in projections with a tail)
    old = checkpoints.quantize_checkpoint(make(tiny_ckpt_dir, **kw))
    dense = make(tiny_ckpt_dir, seed=1, **kw)
    new = checkpoints.quantize_checkpoint(dense)
    opts = dict(max_total_tokens=600, fp8_weights="keep")
    with Engine(new, **opts) as fresh:
        want = fresh.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
    with Engine(old, **opts) as engine:
        before = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
        w_in = engine.model.layers[3].mixer.o_proj.weight
        engine.update_weights_from_disk(new)
        assert engine.model.layers[3].mixer.o_proj.weight is w_in and w_in.dtype == torch.float8_e4m3fn  # in place
        got = engine.generate(input_ids=PROMPTS, sampling_params=_greedy(16))
        for source, blocks_ref in [(dense, new), (checkpoints.quantize_checkpoint(dense, block=(32, 32)), None)]:
            engine.update_weights_from_disk(source)
            kept = load_model(blocks_ref, keep_fp8=True) if blocks_ref else None
            plain = load_model(source)
            for name, p in engine.model.named_parameters():
                value = dict(plain.named_parameters())[name]
                if not is_fp8(p):
                    assert torch.equal(p, value), name
                    continue
                module, _, param = name.rpartition(".")
                tail = getattr(engine.model.get_submodule(module), f"{param}_tail", None)
                rows = p.shape[0] - (0 if tail is None else tail.shape[0])  # the float8 ones
                if tail is not None:  # the tail: the new values as they are, its float8 rows and scales zero
                    assert torch.equal(tail, value[rows:]) and not p[rows:].float().any(), name
                    assert not _kept_scale(engine.model, name)[rows // 64:].any(), name
                if kept is not None:  # quantized per 64 x 64 block from the unquantized values: the FP8 checkpoint's
                    want_q, want_s = dict(kept.named_parameters())[name], _kept_scale(kept, name)
                else:  # from the 32 x 32 checkpoint's dequantized values, quantized again
                    want_q, want_s = Fp8Scheme((64, 64)).quantize(value[:rows])
                assert torch.equal(p[:rows].float(), want_q[:rows].float()), name
                assert torch.equal(_kept_scale(engine.model, name)[:rows // 64], want_s[:rows // 64]), name
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["output_ids"] for o in before] != [o["output_ids"] for o in want]


def test_quantize_fp8_at_load_is_the_fp8_checkpoints_quantization(qwen3_next_moe_path):
    """``quantize_fp8``: an unquantized checkpoint's projections and experts quantized per 128 x 128
    block at load — exactly the float8 weights and scales of the FP8 checkpoint quantized the same
    way, where that one keeps them; the rest of them too (Gated DeltaNet's regrouped in projection);
    never lm_head, the router, the shared expert's one-row gate, the norms."""

    online = load_model(qwen3_next_moe_path, quantize_fp8=True)
    kept = load_model(checkpoints.quantize_checkpoint(qwen3_next_moe_path, block=(128, 128)), keep_fp8=True)
    po, pk = dict(online.named_parameters()), dict(kept.named_parameters())
    fp8_kept = [name for name, p in pk.items() if is_fp8(p)]
    assert fp8_kept
    for name in fp8_kept:
        module, _, param = name.rpartition(".")
        assert torch.equal(po[name].float(), pk[name].float()), name
        assert torch.equal(getattr(online.get_submodule(module), f"{param}_scale"),
                           getattr(kept.get_submodule(module), f"{param}_scale")), name
    assert online.layers[0].mixer.in_proj.weight.dtype == FP8 != kept.layers[0].mixer.in_proj.weight.dtype
    ffn = online.layers[0].ffn
    assert ffn.router.weight.dtype == ffn.shared_expert_gate.weight.dtype == online.lm_head.weight.dtype \
        == online.norm.weight.dtype == torch.float32


def test_quantize_fp8_at_load_quantizes_the_mtp_head(qwen3_next_moe_mtp_path):
    """``quantize_fp8`` quantizes the MTP head as the model: its projections and experts exactly the float8 weights and
    scales of the FP8 checkpoint's head quantized the same way (the rest of them too: those the FP8 checkpoint's
    head does not keep, quantized from their values), its norms and router not."""
    from hyla.model.mtp import MtpHead

    online = MtpHead.from_model(load_model(qwen3_next_moe_mtp_path, quantize_fp8=True))
    kept = MtpHead.from_model(load_model(checkpoints.quantize_checkpoint(qwen3_next_moe_mtp_path, block=(128, 128)),
                                         keep_fp8=True))
    po, pk = dict(online.named_parameters()), dict(kept.named_parameters())
    assert {"fc.weight", "layer.mixer.qkv_proj.weight", "layer.ffn.w_in", "layer.ffn.w_out"} <= \
        {name for name, p in po.items() if is_fp8(p)}
    for name, p in pk.items():
        if is_fp8(p):
            module, _, param = name.rpartition(".")
            assert torch.equal(po[name].float(), p.float()), name
            assert torch.equal(getattr(online.get_submodule(module), f"{param}_scale"),
                               getattr(kept.get_submodule(module), f"{param}_scale")), name
    assert online.norm.weight.dtype == online.layer.ffn.router.weight.dtype == torch.float32


def test_engine_quantization_fp8_cache_on_and_off(qwen3_next_moe_path):
    """``Engine(quantization="fp8")``: the cache never changes what the quantized model computes —
    the differential workload with the prefix cache on (eviction, retraction) and off gives the same
    greedy tokens and logprobs (1e-4, up to a tie)."""
    from test_engine_differential import assert_drained, compare_outputs, make_workload, run

    wave1, _ = make_workload(12, 2048, num_sessions=8, num_shared=8, scale=0.5)
    outs = []
    for cache in (True, False):
        with Engine(qwen3_next_moe_path, quantization="fp8", enable_prefix_cache=cache, **OPTS) as engine:
            assert "quantized to FP8 at load" in engine.summary() and engine.keeps_fp8
            outs.append(run(engine, wave1))
            assert_drained(engine)
            assert engine.get_stats()["num_evicted_tokens"] > 0 or not cache
    assert compare_outputs(*outs) > 0.9 * sum(s["max_new"] for s in wave1)


@pytest.mark.parametrize("opts, match", [
    (dict(fp8_weights="yes"), "fp8_weights must be one of"),
    (dict(quantization="int4"), "quantization must be one of"),
    (dict(quantization="fp8", fp8_weights="dequantize"), "contradicts"),
])
def test_bad_fp8_options(opts, match):
    from hyla.engine.args import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(**opts)


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["qwen3_next_moe_path", "qwen3_5_path"])
def test_gpu_engine_with_kept_fp8_weights(fixture, request):
    """On a GPU (fp32, CUDA graphs, the fused decode and extend): an engine keeping the FP8 weights
    (``fp8_weights`` auto: its projections on ``ops/gpu/fp8.py``, its experts on the FP8 paths of the
    gathered and grouped kernels) against one dequantizing them (the same kernels in fp32, cuBLAS):
    the differential workload's greedy tokens and logprobs within 1e-4 up to each first tie."""
    from test_engine_differential import assert_drained, compare_outputs, make_workload, run

    fp8 = checkpoints.quantize_checkpoint(request.getfixturevalue(fixture), block=(128, 128))
    wave1, _ = make_workload(13, 2048, num_sessions=16, num_shared=16, scale=0.5)
    outs = {}
    for mode in ("auto", "dequantize"):
        with Engine(fp8, device="cuda", fp8_weights=mode, **OPTS) as engine:
            assert engine.keeps_fp8 == (mode == "auto") and engine.scheduler.runner.graphs is not None
            outs[mode] = run(engine, wave1)
            assert_drained(engine)
    assert compare_outputs(outs["auto"], outs["dequantize"]) > 0.9 * sum(s["max_new"] for s in wave1)


def test_the_compiled_graphs_expert_op_takes_fp8_experts(qwen3_next_moe_path):
    """``torch.ops.hyla.moe_experts_fp8`` (the op a ``compile_decode`` graph runs a MoE layer's float8
    experts with) takes their scales and blocks: what the eager sorted path computes.
    (An engine with ``quantization="fp8"`` and ``compile_decode`` gave the eager one's greedy tokens
    and logprobs on the 2-layer Qwen3-Next MoE, by hand: compiling it costs minutes.)"""
    from hyla.model.layers import sparse_moe

    ffn = load_model(qwen3_next_moe_path, quantize_fp8=True).layers[0].ffn
    assert is_fp8(ffn.w_in) and is_fp8(ffn.w_out)
    x = torch.randn(5, 256)
    weights, experts = ffn.route(x)
    fp8_in, fp8_out = (ffn.w_in_scale, ffn.w_in_block), (ffn.w_out_scale, ffn.w_out_block)
    want = sparse_moe.run_experts_sorted(x, weights, experts, ffn.w_in, ffn.w_out, ffn.gated, fp8_in, fp8_out)
    got = torch.ops.hyla.moe_experts_fp8(x, weights, experts, ffn.w_in, ffn.w_out, ffn.gated, in_scale=ffn.w_in_scale,
                                     in_block=list(ffn.w_in_block), out_scale=ffn.w_out_scale,
                                     out_block=list(ffn.w_out_block))
    assert torch.equal(got, want)
    dense = sparse_moe.run_experts_sorted(x, weights, experts, sparse_moe.dequantized(ffn.w_in, *fp8_in, x.dtype),
                                          sparse_moe.dequantized(ffn.w_out, *fp8_out, x.dtype), ffn.gated)
    assert (got - dense).abs().max() < 1e-5


def test_fp8_experts_on_every_path(qwen3_next_moe_path):
    """A MoE layer's float8 experts on the paths the engine tests reach only on a GPU or replace: the
    experts gathered without Triton (``expert_matvec``'s dequantizing fallback), the sorted path
    traced whole (``run_experts`` under ``torch.compile``: the ``moe_experts_fp8`` op, given each
    side's scales); and ``fuse_inputs_`` leaves a float8 shared expert apart from the router."""
    from hyla.model.layers import sparse_moe

    plain = load_model(qwen3_next_moe_path).layers[0].ffn
    ffn = load_model(qwen3_next_moe_path, quantize_fp8=True).layers[0].ffn
    x = torch.randn(5, 256)
    weights, experts = ffn.route(x)
    w_in = sparse_moe.dequantized(ffn.w_in, ffn.w_in_scale, ffn.w_in_block, x.dtype)
    w_out = sparse_moe.dequantized(ffn.w_out, ffn.w_out_scale, ffn.w_out_block, x.dtype)
    flat = experts.flatten()
    got = sparse_moe.expert_matvec(ffn.w_in, flat, x, per_row=2, fp8=(ffn.w_in_scale, ffn.w_in_block))
    assert (got - sparse_moe.expert_matvec(w_in, flat, x, per_row=2)).abs().max() < 1e-5
    want = ffn.run_experts(x, weights, experts)
    dense = sparse_moe.run_experts_sorted(x, weights, experts, w_in, w_out, ffn.gated)
    assert (want - dense).abs().max() < 1e-5
    compiled = torch.compile(ffn.run_experts, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, weights, experts), want)
    assert plain.fuse_inputs_() and not ffn.fuse_inputs_()


def test_fp8_linear_takes_any_rows(monkeypatch):
    """``fp8_linear`` on a GPU's path (here the kernels interpreted): inputs of more than two dims,
    and columns of a stride other than one, give the reference's result."""
    from hyla.model import quantization
    from hyla.model.layers import device

    g = torch.Generator().manual_seed(0)
    q, s = Fp8Scheme((32, 64)).quantize(torch.randn(48, 96, generator=g))
    x = torch.randn(2, 3, 192, generator=g)[..., ::2]  # [2, 3, 96], column stride 2
    want = torch.nn.functional.linear(x, Fp8Scheme((32, 64)).dequantize(q, s))
    monkeypatch.setattr(device, "on_gpu", lambda t: True)
    got = quantization.fp8_linear(x, q, s, (32, 64))
    assert got.shape == (2, 3, 48) and (got - want).abs().max() < 1e-5
