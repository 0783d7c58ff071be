"""load_model: sharded checkpoints, dtypes, name layouts (backbone., language_model., per-expert or fused experts),
tied embeddings, mtp.* kept aside, and the errors for checkpoints that do not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import BAILING_HYBRID_KW, KIMI_LINEAR_KW, TinyRunner, make_lfm2, make_qwen3_5
from safetensors.torch import load_file, save_file

from hyla.model import load_model
from hyla.model.architectures import SUPPORTED_ARCHITECTURES


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    runner = TinyRunner(model)
    return runner.step([runner.new_seq()], [ids], all_logits=True)


IDS = list(range(5, 75))


def rewrite(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """Copy checkpoint ``src`` to ``dst`` (single file), editing its tensors and/or config."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        config = edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_sharded_checkpoint_loads_identically(qwen3_next_moe_path, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_next_moe_path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    single, sharded = load_model(qwen3_next_moe_path), load_model(tmp_path)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    # experts are stacked: [E, 2I, H] and [E, H, I]
    moe = single.layers[0].ffn
    assert tuple(moe.w_in.shape) == (8, 256, 256) and tuple(moe.w_out.shape) == (8, 256, 128)
    ref = load_file(qwen3_next_moe_path / "model.safetensors")
    assert torch.equal(moe.w_in[3, 128:], ref["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(moe.w_out[5], ref["model.layers.0.mlp.experts.5.down_proj.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dtypes(nemotron_h_path, dtype):
    fp32 = load_model(nemotron_h_path)
    half = load_model(nemotron_h_path, dtype=str(dtype).removeprefix("torch."))
    assert half.config.dtype == dtype and half.embed_tokens.weight.dtype == dtype
    mixer = half.layers[0].mixer
    assert mixer.A_log.dtype == mixer.dt_bias.dtype == mixer.D.dtype == torch.float32
    assert half.layers[6].ffn.e_score_correction_bias.dtype == torch.float32
    runner = TinyRunner(half)
    assert runner.conv_states[0].dtype == dtype and runner.ssm_states[0].dtype == torch.float32
    got = prefill_logits(half, IDS)
    want = prefill_logits(fp32, IDS)
    assert got.dtype == torch.float32
    assert (got - want).abs().mean() < 0.05 * want.std()  # same model, rounding noise only
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_nemotron_h_backbone_and_model_prefixes(nemotron_h_path, tmp_path):
    names = load_file(nemotron_h_path / "model.safetensors").keys()
    assert all(n.startswith("backbone.") or n == "lm_head.weight" for n in names)
    renamed = rewrite(
        nemotron_h_path, tmp_path / "renamed",
        edit_tensors=lambda t: {k.replace("backbone.", "model.", 1): v for k, v in t.items()},
    )
    assert torch.equal(prefill_logits(load_model(renamed), IDS), prefill_logits(load_model(nemotron_h_path), IDS))


def test_qwen3_5_vision_language_layout_and_mtp(qwen3_5_path, tmp_path):
    """Qwen3_5ForConditionalGeneration: text weights under model.language_model., vision tower
    ignored, mtp.* kept aside in model.mtp_weights."""

    def to_vl(tensors):
        out = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
        out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
        out["mtp.fc.weight"] = torch.ones(8, 16)
        out["mtp.layers.0.input_layernorm.weight"] = torch.ones(16)
        return out

    def vl_config(text):
        text = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
        return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                "text_config": text, "tie_word_embeddings": False}

    vl = rewrite(qwen3_5_path, tmp_path / "vl", edit_tensors=to_vl, edit_config=vl_config)
    model = load_model(vl)
    assert model.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert set(model.mtp_weights) == {"mtp.fc.weight", "mtp.layers.0.input_layernorm.weight"}
    assert torch.equal(model.mtp_weights["mtp.fc.weight"], torch.ones(8, 16))
    assert torch.equal(prefill_logits(model, IDS), prefill_logits(load_model(qwen3_5_path), IDS))


def test_qwen3_5_vision_tower_equals_transformers(qwen3_5_vl_path, tmp_path):
    """A checkpoint with a vision_config builds the vision tower from model.visual.*: its embeddings of
    images of several grids (two frames in one) equal transformers' Qwen3_5VisionModel's; a missing tower
    tensor is named, and a tower whose output is not the text model's width is refused."""
    model = load_model(qwen3_5_vl_path)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(qwen3_5_vl_path, dtype=torch.float32).eval()
    grids = [(1, 4, 6), (2, 2, 2), (1, 8, 4)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    out = model.visual(pixels, grids)
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, 256)
    assert (out - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="must be"):
        model.visual(pixels[:-1], grids)

    name = "model.visual.blocks.1.attn.qkv.bias"
    bad = rewrite(qwen3_5_vl_path, tmp_path / "bad", edit_tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="lacks") as err:
        load_model(bad)
    assert name.removeprefix("model.") in str(err.value)  # (named as the loader normalises it)
    wide = rewrite(qwen3_5_vl_path, tmp_path / "wide",
                   edit_config=lambda c: {**c, "vision_config": {**c["vision_config"], "out_hidden_size": 128}})
    with pytest.raises(ValueError, match="out_hidden_size"):
        load_model(wide)


def test_tied_embeddings_share_storage_and_match_hf(tiny_ckpt_dir):
    path = make_qwen3_5(tiny_ckpt_dir, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert (prefill_logits(model, IDS) - ref).abs().max() <= 1e-4


def test_missing_tensor_is_named(qwen3_next_dense_path, tmp_path):
    name = "model.layers.3.self_attn.k_norm.weight"
    bad = rewrite(qwen3_next_dense_path, tmp_path / "bad", edit_tensors=lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="lacks") as err:
        load_model(bad)
    assert name in str(err.value)


def test_unexpected_tensor_is_named(qwen3_next_dense_path, tmp_path):
    name = "model.layers.2.linear_attn.surprise.weight"
    bad = rewrite(qwen3_next_dense_path, tmp_path / "bad", edit_tensors=lambda t: {**t, name: torch.zeros(2)})
    with pytest.raises(ValueError, match="does not use") as err:
        load_model(bad)
    assert name in str(err.value)


def test_dense_checkpoint_with_moe_config_names_the_expert_tensors(qwen3_next_dense_path, tmp_path):
    bad = rewrite(qwen3_next_dense_path, tmp_path / "bad",
                  edit_config=lambda c: {**c, "num_experts": 4, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.") as err:
        load_model(bad)
    assert "lacks" in str(err.value)


def test_wrong_shape_is_named(qwen3_next_dense_path, tmp_path):
    bad = rewrite(qwen3_next_dense_path, tmp_path / "bad", edit_config=lambda c: {**c, "intermediate_size": 384})
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape") as err:
        load_model(bad)
    assert "layers.0" in str(err.value)


def test_unsupported_architecture_lists_supported(qwen3_next_dense_path, tmp_path):
    bad = rewrite(qwen3_next_dense_path, tmp_path / "bad",
                  edit_config=lambda c: {**c, "architectures": ["RwkvForCausalLM"], "model_type": "rwkv"})
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        load_model(bad)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_files_are_value_errors(qwen3_next_dense_path, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="cannot be read"):  # (a name the OS refuses: ENAMETOOLONG)
        load_model(tmp_path / ("x" * 300))
    good = json.loads((qwen3_next_dense_path / "config.json").read_text())
    for text, match in (("[1, 2]", "JSON list, not an object"), ("null", "JSON NoneType"), ("{", "Expecting"),
                        (json.dumps({**good, "layer_types": 5}), "malformed")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            load_model(tmp_path)
    shutil.copy(qwen3_next_dense_path / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="gone.safetensors"):
        load_model(tmp_path)


def two_shards(src: Path, dst: Path, edit_shards=None, edit_index=None) -> Path:
    """Copy checkpoint ``src`` to ``dst`` as two shards and an index, then edit the shards (a dict of
    file name -> tensors) and/or the index (its JSON object, or the text written instead)."""
    dst.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {k: tensors[k] for k in part}
              for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]))}
    if edit_shards:
        edit_shards(shards)
    for file, part in shards.items():
        save_file(part, dst / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: file for file, part in shards.items() for name in part}}
    if edit_index:
        index = edit_index(index) or index
    (dst / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_index_and_shards_must_agree(qwen3_next_dense_path, tmp_path):
    """An index is checked against its shards' headers before any tensor is read: a tensor in two
    shards, one listed in a shard that lacks it, or one a shard holds that the index does not list
    there is a ``ValueError`` naming it; so is an index that is no JSON object of name -> file name."""
    one, two = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    load_model(two_shards(qwen3_next_dense_path, tmp_path / "good"))

    def copy_first(shards):  # the first tensor of the first shard, in the second too (other values)
        name = min(shards[one])
        shards[two][name] = shards[one][name] * 2

    def move_first(shards):  # ... moved to the second, the index still naming the first
        name = min(shards[one])
        shards[two][name] = shards[one].pop(name)

    def still_first(index):
        index["weight_map"][min(index["weight_map"])] = one

    first = min(load_file(qwen3_next_dense_path / "model.safetensors"))
    cases = [
        (dict(edit_shards=copy_first), rf"'{first}' is in two shards, {one} and {two} \(which"),  # (the index: the last)
        (dict(edit_shards=move_first, edit_index=still_first),
         rf"lists tensor\(s\) in {one} that it does not hold: {first}"),
        (dict(edit_index=lambda i: i["weight_map"].pop(first) and None),
         rf"{one} holds tensor\(s\) that .* not list: {first}"),
        (dict(edit_index=lambda i: "[1, 2]"), "has no weight_map"),
        (dict(edit_index=lambda i: "{"), "index.json is not valid UTF-8 JSON"),
        (dict(edit_index=lambda i: i["weight_map"].update({first: None})),
         rf"gives tensor '{first}' the shard file None"),
    ]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_model(two_shards(qwen3_next_dense_path, tmp_path / str(i), **edit))


def test_sources_that_do_not_combine_are_named_with_their_shapes(qwen3_next_dense_path, tmp_path):
    """A source of other dims than its combine takes (a conv weight flattened) is a ``ValueError``
    naming it, not torch's ``IndexError``; each source is named beside its own shape."""
    conv, k_proj = "model.layers.0.linear_attn.conv1d.weight", "model.layers.3.self_attn.k_proj.weight"
    flat = rewrite(qwen3_next_dense_path, tmp_path / "flat", edit_tensors=lambda t: {**t, conv: t[conv].flatten()})
    with pytest.raises(ValueError, match=rf"{conv} \(2048,\) do not make layers\.0\.mixer\.conv_weight"):
        load_model(flat)
    turned = rewrite(qwen3_next_dense_path, tmp_path / "turned",
                     edit_tensors=lambda t: {**t, k_proj: t[k_proj].T.contiguous()})
    with pytest.raises(ValueError, match=rf"q_proj\.weight \(512, 256\), {k_proj} \(256, 128\), "
                                         rf".*v_proj\.weight \(128, 256\) do not make"):
        load_model(turned)


def test_an_fp32_load_holds_one_copy_of_each_weight(qwen3_next_dense_path, monkeypatch):
    """Loading relays fp32 CPU projection weights column-major (``relayout_weights_``, a load hook):
    the row-major memory each had is freed as it is replaced, not held until the load returns (a
    second copy of nearly every weight at the load's peak)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from hyla.model.layers import HybridForCausalLM

    relayout, seen = HybridForCausalLM.relayout_weights_, []

    def watched(model):  # (a weak reference keeps a storage's address from reuse, not its memory)
        before = {name: StorageWeakRef(p.untyped_storage()) for name, p in model.named_parameters()}
        relayout(model)
        relaid = [name for name, p in model.named_parameters() if p.untyped_storage()._cdata != before[name].cdata]
        seen.append((relaid, [name for name in relaid if not before[name].expired()]))

    monkeypatch.setattr(HybridForCausalLM, "relayout_weights_", watched)
    load_model(qwen3_next_dense_path)
    (relaid, still_held), = seen
    assert "lm_head.weight" in relaid and len(relaid) > 10  # (the hook ran, and gave these new memory)
    assert still_held == []


def test_falcon_h1_multipliers_are_folded_into_the_weights(falcon_h1_path, tmp_path):
    model = load_model(falcon_h1_path)
    c, raw = model.config, load_file(falcon_h1_path / "model.safetensors")
    src = "model.layers.1"
    layer = model.layers[1]
    assert torch.allclose(model.embed_tokens.weight, raw["model.embed_tokens.weight"] * c.embedding_multiplier)
    assert torch.allclose(model.lm_head.weight, raw["lm_head.weight"] * c.lm_head_multiplier)
    q, k, v = layer.attn.qkv_proj.weight.split([4 * 64, 2 * 64, 2 * 64])
    m_in = c.attention_in_multiplier
    assert torch.allclose(q, raw[f"{src}.self_attn.q_proj.weight"] * m_in)
    assert torch.allclose(k, raw[f"{src}.self_attn.k_proj.weight"] * m_in * c.key_multiplier)
    assert torch.allclose(v, raw[f"{src}.self_attn.v_proj.weight"] * m_in)
    assert torch.allclose(layer.attn.o_proj.weight, raw[f"{src}.self_attn.o_proj.weight"] * c.attention_out_multiplier)
    # in_proj rows [z (384) | x (384) | B (64) | C (64) | dt (12)], each segment with its ssm_multiplier
    rows = layer.mamba.in_proj.weight.split([384, 384, 64, 64, 12])
    for got, want, m in zip(rows, raw[f"{src}.mamba.in_proj.weight"].split([384, 384, 64, 64, 12]), c.ssm_multipliers):
        assert torch.allclose(got, want * c.ssm_in_multiplier * m)
    assert torch.allclose(layer.mamba.out_proj.weight, raw[f"{src}.mamba.out_proj.weight"] * c.ssm_out_multiplier)
    gate, up = layer.ffn.in_proj.weight.chunk(2)
    assert torch.allclose(gate, raw[f"{src}.feed_forward.gate_proj.weight"] * c.mlp_multipliers[0])
    assert torch.equal(up, raw[f"{src}.feed_forward.up_proj.weight"])
    assert torch.allclose(layer.ffn.out_proj.weight, raw[f"{src}.feed_forward.down_proj.weight"] * c.mlp_multipliers[1])
    # bf16: the multipliers are folded in fp32 before the cast; SSM parameters stay fp32
    half = load_model(falcon_h1_path, dtype="bfloat16")
    assert half.layers[0].mamba.in_proj.weight.dtype == torch.bfloat16 and half.layers[0].mamba.D.dtype == torch.float32
    got, want = prefill_logits(half, IDS), prefill_logits(model, IDS)
    assert (got - want).abs().mean() < 0.05 * want.std()
    # a checkpoint whose Mamba norm the config switches off: the norm weights are unexpected
    off = rewrite(falcon_h1_path, tmp_path / "no_norm", edit_config=lambda cfg: {**cfg, "mamba_rms_norm": False})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.mamba\.norm\.weight"):
        load_model(off)


def test_granite_h_reads_published_and_transformers_v5_names(granite_h_path, tmp_path):
    """The published layout (block_sparse_moe.input_linear / output_linear / router.layer) and
    transformers v5's in-memory names (experts.gate_up_proj / down_proj, router.weight) load the same."""
    renames = {".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
               ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
               ".block_sparse_moe.router.layer.weight": ".block_sparse_moe.router.weight"}

    def to_v5(tensors):
        out = {}
        for name, t in tensors.items():
            for old, new in renames.items():
                name = name.replace(old, new)
            out[name] = t
        return out

    v5 = rewrite(granite_h_path, tmp_path / "v5", edit_tensors=to_v5)
    published, renamed = load_model(granite_h_path), load_model(v5)
    for (name, a), (_, b) in zip(published.state_dict().items(), renamed.state_dict().items()):
        assert torch.equal(a, b), name
    c = published.config
    raw = load_file(granite_h_path / "model.safetensors")
    moe = published.layers[0].ffn
    assert torch.equal(moe.w_in, raw["model.layers.0.block_sparse_moe.input_linear.weight"])
    assert torch.allclose(moe.w_out, raw["model.layers.0.block_sparse_moe.output_linear.weight"] * c.residual_multiplier)
    q = published.layers[2].mixer.qkv_proj.weight[: 4 * 64]
    assert torch.allclose(q, raw["model.layers.2.self_attn.q_proj.weight"] * c.attention_multiplier * 64**0.5)


def to_published_qwen3_5_moe(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """transformers' save_pretrained layout -> the published Qwen3.5-MoE one: experts fused per layer
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) under the vision-language
    prefix ``model.language_model.``, plus a vision tower and an MTP tensor hyla must leave alone."""
    out, layers = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            layer = name.split(".mlp.experts.")[0]
            layers.setdefault(layer, {})[name.split(".mlp.experts.")[1]] = t
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for layer, parts in layers.items():
        prefix = layer.replace("model.", "model.language_model.", 1) + ".mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack([
            torch.cat([parts[f"{e}.gate_proj.weight"], parts[f"{e}.up_proj.weight"]]) for e in range(num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[f"{e}.down_proj.weight"] for e in range(num_experts)])
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(4, 4)
    return out


def test_qwen3_5_moe_reads_the_published_fused_layout_and_the_per_expert_one(qwen3_5_moe_path, tmp_path):
    """The published checkpoint (vision-language config, model.language_model. prefix, fused experts)
    and transformers' save_pretrained layout (per-expert tensors) give the same weights."""
    def to_vl(cfg: dict) -> dict:
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "tie_word_embeddings")}
        return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                "text_config": {**text, "model_type": "qwen3_5_moe_text"},  # (no vision_config: the text model alone)
                "tie_word_embeddings": cfg["tie_word_embeddings"]}

    published = rewrite(qwen3_5_moe_path, tmp_path / "published",
                        edit_tensors=lambda t: to_published_qwen3_5_moe(t, 8), edit_config=to_vl)
    per_expert, fused = load_model(qwen3_5_moe_path), load_model(published)
    assert fused.config.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert fused.config.ffn_types == ("moe",) * 8 and set(fused.mtp_weights) == {
        "mtp.layers.0.mlp.experts.0.gate_proj.weight"}
    for (name, a), (_, b) in zip(per_expert.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(a, b), name
    raw = load_file(qwen3_5_moe_path / "model.safetensors")
    moe = per_expert.layers[3].ffn  # experts stacked [E, 2I, H] = [gate | up], [E, H, I]
    assert tuple(moe.w_in.shape) == (8, 256, 256) and tuple(moe.w_out.shape) == (8, 256, 128)
    assert torch.equal(moe.w_in[6, :128], raw["model.layers.3.mlp.experts.6.gate_proj.weight"])
    assert torch.equal(moe.w_in[6, 128:], raw["model.layers.3.mlp.experts.6.up_proj.weight"])
    assert torch.equal(moe.w_out[2], raw["model.layers.3.mlp.experts.2.down_proj.weight"])
    assert torch.equal(prefill_logits(per_expert, IDS), prefill_logits(fused, IDS))

    # neither layout complete: the error names the published tensors; both at once: the published one is
    # read and the per-expert tensors are unexpected
    def drop_down(t):
        return {k: v for k, v in t.items() if k != "model.language_model.layers.5.mlp.experts.down_proj"}

    broken = rewrite(published, tmp_path / "broken", edit_tensors=drop_down)
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) .*layers\.5\.mlp\.experts\.down_proj"):
        load_model(broken)
    both = rewrite(qwen3_5_moe_path, tmp_path / "both", edit_tensors=lambda t: {
        **t, "model.layers.0.mlp.experts.down_proj": torch.zeros(8, 256, 128)})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight"):
        load_model(both)


def test_lfm2_tensor_layout(tmp_path):
    """Short-conv layers (in_proj [B | C | x], depthwise conv [H, 1, K] -> [H, K]), attention with
    out_proj and q/k layernorms, w1/w3/w2 MLP, embedding_norm as the final norm, tied lm_head (as
    the released LFM2 models; the other tests' tiny LFM2 is untied, see checkpoints.LFM2_KW)."""
    lfm2_path = make_lfm2(tmp_path, tie_word_embeddings=True)
    model = load_model(lfm2_path)
    raw = load_file(lfm2_path / "model.safetensors")
    conv, attn = model.layers[0].mixer, model.layers[2].mixer
    assert torch.equal(conv.conv_weight, raw["model.layers.0.conv.conv.weight"][:, 0])
    assert tuple(conv.conv_weight.shape) == (256, 3) and conv.conv_bias is None
    assert torch.equal(conv.in_proj.weight, raw["model.layers.0.conv.in_proj.weight"])
    assert torch.equal(attn.o_proj.weight, raw["model.layers.2.self_attn.out_proj.weight"])
    assert torch.equal(attn.k_norm.weight, raw["model.layers.2.self_attn.k_layernorm.weight"])
    gate, up = model.layers[1].ffn.in_proj.weight.chunk(2)  # MLP width 512 (HF's auto-adjusted 700)
    assert gate.shape == (512, 256) and torch.equal(up, raw["model.layers.1.feed_forward.w3.weight"])
    assert torch.equal(model.norm.weight, raw["model.embedding_norm.weight"])
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()  # tied


def _in_memory_checkpoint(path, tmp_path):
    """A checkpoint of transformers' in-memory state dict (its fused names, not what save_pretrained
    writes), beside the same config.json."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = tmp_path / "in_memory"
    out.mkdir()
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:  # a tied lm_head is the embedding (save_pretrained leaves it out too)
        state.pop("lm_head.weight")
    # (copies: a model's tied modules share their tensors, which safetensors refuses to write twice)
    save_file({k: v.contiguous().clone() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(path / "config.json", out / "config.json")
    return out


def _assert_same_weights(a, b) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def _both_layouts(path, tmp_path, in_memory_name: str):
    """The checkpoint at ``path`` and :func:`_in_memory_checkpoint` of it (which must hold ``in_memory_name``,
    a name of transformers' own), loaded, their weights asserted equal: ``(published, in-memory, the
    published file's tensors)``."""
    in_memory = _in_memory_checkpoint(path, tmp_path)
    assert in_memory_name in load_file(in_memory / "model.safetensors")
    published, fused = load_model(path), load_model(in_memory)
    _assert_same_weights(published, fused)
    return published, fused, load_file(path / "model.safetensors")


def test_kimi_linear_reads_moonshot_and_transformers_in_memory_names(kimi_linear_path, tmp_path):
    """Moonshot's layout (what save_pretrained writes: q/k/v_conv1d, f_a/f_b/dt_bias/A_log on self_attn,
    block_sparse_moe.experts.{e}.w1/w3/w2, the dense MLP under block_sparse_moe) and transformers'
    in-memory state dict (fused conv1d, forget_gate.*, mlp.*, experts.gate_up_proj / down_proj) load the
    same weights; lm_head is never tied."""
    moonshot, fused, raw = _both_layouts(kimi_linear_path, tmp_path, "model.layers.1.mlp.experts.gate_up_proj")
    kda, mla, moe = moonshot.layers[0].mixer, moonshot.layers[2].mixer, moonshot.layers[1].ffn
    hd = KIMI_LINEAR_KW["linear_num_heads"] * KIMI_LINEAR_KW["linear_head_dim"]
    assert torch.equal(kda.conv_weight[hd : 2 * hd], raw["model.layers.0.self_attn.k_conv1d.weight"][:, 0])
    assert torch.equal(kda.A_log, raw["model.layers.0.self_attn.A_log"].flatten())
    assert torch.equal(kda.qkv_proj.weight[2 * hd :], raw["model.layers.0.self_attn.v_proj.weight"])
    assert torch.equal(mla.kv_a_proj.weight, raw["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"])
    assert torch.equal(moe.w_in[3, 128:], raw["model.layers.1.block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(moe.w_out[5], raw["model.layers.1.block_sparse_moe.experts.5.w2.weight"])
    assert torch.equal(moonshot.layers[0].ffn.out_proj.weight, raw["model.layers.0.block_sparse_moe.down_proj.weight"])
    assert moonshot.lm_head.weight.data_ptr() != moonshot.embed_tokens.weight.data_ptr()
    assert torch.equal(prefill_logits(moonshot, IDS), prefill_logits(fused, IDS))


def test_lfm2_moe_reads_per_expert_and_fused_experts(lfm2_moe_path, tmp_path):
    """LiquidAI's per-expert layout (what save_pretrained writes: feed_forward.experts.{e}.w1/w3/w2) and
    transformers' in-memory state dict (experts.gate_up_proj [E, 2I, H] = [gate | up], down_proj [E, H, I])
    load the same weights; the router is feed_forward.gate, its bias the block's fp32 expert_bias; the dense
    layer's MLP is LFM2's w1/w3/w2. A checkpoint without the bias is refused unless use_expert_bias is off."""
    per_expert, fused, raw = _both_layouts(lfm2_moe_path, tmp_path, "model.layers.1.feed_forward.experts.gate_up_proj")
    moe, mlp = per_expert.layers[1].ffn, per_expert.layers[0].ffn
    src = "model.layers.1.feed_forward"
    gate, up = moe.w_in[3].chunk(2)  # [2I, H]: [gate | up]
    assert torch.equal(gate, raw[f"{src}.experts.3.w1.weight"]) and torch.equal(up, raw[f"{src}.experts.3.w3.weight"])
    assert torch.equal(moe.w_out[3], raw[f"{src}.experts.3.w2.weight"])
    assert torch.equal(moe.router.weight, raw[f"{src}.gate.weight"]) and moe.shared_expert is None
    assert moe.e_score_correction_bias.dtype == torch.float32 and bool(moe.e_score_correction_bias.ne(0).all())
    assert torch.equal(moe.e_score_correction_bias, raw[f"{src}.expert_bias"])
    assert torch.equal(mlp.in_proj.weight.chunk(2)[1], raw["model.layers.0.feed_forward.w3.weight"])
    assert torch.equal(prefill_logits(per_expert, IDS), prefill_logits(fused, IDS))

    def drop_bias(t):
        return {k: v for k, v in t.items() if not k.endswith("expert_bias")}

    with pytest.raises(ValueError, match=r"lacks tensor\(s\) .*layers\.1\.feed_forward\.expert_bias"):
        load_model(rewrite(lfm2_moe_path, tmp_path / "no_bias", edit_tensors=drop_bias))
    unbiased = load_model(rewrite(lfm2_moe_path, tmp_path / "unbiased", edit_tensors=drop_bias,
                                  edit_config=lambda c: {**c, "use_expert_bias": False}))
    assert unbiased.layers[1].ffn.e_score_correction_bias is None


def test_bailing_hybrid_reads_inclusionai_and_transformers_names_and_skips_mtp_layers(bailing_hybrid_path, tmp_path):
    """Ling 3: inclusionAI's layout (what save_pretrained writes: word_embeddings, attention.* with dense as the
    output projection, q/k/v_conv1d, f_proj / g_proj, mlp.gate.expert_bias, experts.{e}.gate/up/down_proj) and
    transformers' in-memory state dict (embed_tokens, self_attn.*, forget_gate.*, fused conv1d and experts,
    e_score_correction_bias) load the same weights; MLA's RoPE rows are de-interleaved (evens, then odds); the
    multi-token-prediction layer after the decoder (num_nextn_predict_layers: 1) is not read, a layer past it
    is refused; lm_head is never tied."""
    ling, fused, raw = _both_layouts(bailing_hybrid_path, tmp_path,
                                     "model.layers.1.self_attn.forget_gate.f_proj.weight")
    kda, mla, moe = ling.layers[0].mixer, ling.layers[2].mixer, ling.layers[1].ffn
    hd = BAILING_HYBRID_KW["num_attention_heads"] * BAILING_HYBRID_KW["head_dim"]
    assert kda.f_a_proj is None and kda.gate == (-5.0, True)
    assert torch.equal(kda.f_proj.weight, raw["model.layers.0.attention.f_proj.weight"])
    assert torch.equal(kda.g_proj.weight, raw["model.layers.0.attention.g_proj.weight"])
    assert torch.equal(kda.conv_weight[2 * hd :], raw["model.layers.0.attention.v_conv1d.weight"][:, 0])
    assert torch.equal(kda.o_proj.weight, raw["model.layers.0.attention.dense.weight"])
    rank, rope = BAILING_HYBRID_KW["kv_lora_rank"], BAILING_HYBRID_KW["qk_rope_head_dim"]
    kv_a = raw["model.layers.2.attention.kv_a_proj_with_mqa.weight"]
    assert torch.equal(mla.kv_a_proj.weight[:rank], kv_a[:rank])
    assert torch.equal(mla.kv_a_proj.weight[rank : rank + rope // 2], kv_a[rank::2])  # the pairs' first halves
    assert torch.equal(mla.kv_a_proj.weight[rank + rope // 2 :], kv_a[rank + 1 :: 2])
    assert torch.equal(mla.g_proj.weight, raw["model.layers.2.attention.g_proj.weight"])
    assert torch.equal(moe.e_score_correction_bias, raw["model.layers.1.mlp.gate.expert_bias"])
    assert torch.equal(moe.w_in[3].chunk(2)[1], raw["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(ling.embed_tokens.weight, raw["model.word_embeddings.weight"])
    assert ling.lm_head.weight.data_ptr() != ling.embed_tokens.weight.data_ptr()
    logits = prefill_logits(ling, IDS)
    assert torch.equal(logits, prefill_logits(fused, IDS))

    def add_layer(n):  # a copy of layer 5's tensors as layer n
        return lambda t: {**t, **{k.replace("layers.5.", f"layers.{n}."): v.clone() for k, v in t.items() if "layers.5." in k}}

    with_mtp = load_model(rewrite(bailing_hybrid_path, tmp_path / "mtp", edit_tensors=add_layer(6)))
    assert torch.equal(prefill_logits(with_mtp, IDS), logits)
    with pytest.raises(ValueError, match=r"does not use: .*model\.layers\.7\."):
        load_model(rewrite(bailing_hybrid_path, tmp_path / "past_mtp", edit_tensors=add_layer(7)))


def test_olmo_hybrid_reads_olmo_core_and_transformers_in_memory_names(olmo_hybrid_path, tmp_path):
    """OLMo-Hybrid: OLMo-core's layout (what save_pretrained writes: attention_layer_norm / feedforward_layer_norm,
    separate q/k/v_conv1d; an attention layer's feedforward_layer_norm is its post-attention norm) and transformers'
    in-memory state dict (input_layernorm / post_attention_layernorm, the fused conv1d) load the same weights: the
    GDN's projections stacked [q | k | v | g | b | a], q/k norms over all heads, the GDN output norm's eps 1e-5."""
    core, fused, raw = _both_layouts(olmo_hybrid_path, tmp_path, "model.layers.0.linear_attn.conv1d.weight")
    gdn, attn = core.layers[0].mixer, core.layers[2].mixer
    kd, vd = 4 * 48, 4 * 64
    assert torch.equal(gdn.in_proj.weight[2 * kd + vd : 2 * kd + 2 * vd], raw["model.layers.0.linear_attn.g_proj.weight"])
    assert torch.equal(gdn.in_proj.weight[-4:], raw["model.layers.0.linear_attn.a_proj.weight"])
    # (transformers' save_pretrained cuts the fused conv into near-equal thirds, 214 / 214 / 212 channels here, not
    # q / k / v's 192 / 192 / 256: only their concatenation is the conv, which is all hyla reads)
    convs = [raw[f"model.layers.0.linear_attn.{p}_conv1d.weight"][:, 0] for p in "qkv"]
    assert torch.equal(gdn.conv_weight, torch.cat(convs)) and gdn.conv_weight.shape[0] == 2 * kd + vd
    assert gdn.norm.eps == 1e-5 and gdn.beta_scale == 2.0
    assert torch.equal(attn.q_whole_norm.weight, raw["model.layers.2.self_attn.q_norm.weight"])
    assert tuple(attn.k_whole_norm.weight.shape) == (4 * 64,) and attn.q_norm is None
    assert torch.equal(core.layers[2].mixer_norm.weight, raw["model.layers.2.feedforward_layer_norm.weight"])
    assert torch.equal(core.layers[2].ffn_norm.weight, raw["model.layers.2.post_feedforward_layernorm.weight"])
    assert torch.equal(core.layers[0].mixer_norm.weight, raw["model.layers.0.attention_layer_norm.weight"])
    assert torch.equal(prefill_logits(core, IDS), prefill_logits(fused, IDS))


def test_lara_mini_reads_the_published_and_transformers_in_memory_names(lara_mini_path, tmp_path):
    """Lara-4-Mini: the published layout (what save_pretrained writes: one fused GDN in_proj whose rows are
    [q | k | v | z | b | a], the gated norm as out_norm, fused experts) and transformers' in-memory state dict
    (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, norm) load the same weights; no shared-expert gate, plain
    (not 1 + w) norms; the sliding layers' window and RoPE, the global layer's none."""
    published, split, raw = _both_layouts(lara_mini_path, tmp_path, "model.layers.0.linear_attn.in_proj_z.weight")
    gdn, moe = published.layers[0].mixer, published.layers[0].ffn
    assert torch.equal(gdn.in_proj.weight, raw["model.layers.0.linear_attn.in_proj.weight"])
    assert torch.equal(gdn.norm.weight, raw["model.layers.0.linear_attn.out_norm.weight"])
    assert moe.shared_expert_gate is None and moe.logits_fp32
    assert torch.equal(moe.w_in, raw["model.layers.0.mlp.experts.gate_up_proj"])
    assert published.norm.offset == 0.0 and published.layers[1].mixer.q_norm.offset == 0.0
    assert [getattr(layer.mixer, "window", None) for layer in published.layers] == [None, 6, None, 0, 6, None]
    assert published.rotary is None and published.sliding_rotary.inv_freq.shape == (32,)
    assert torch.equal(prefill_logits(published, IDS), prefill_logits(split, IDS))


def test_lfm3_reads_the_published_and_transformers_in_memory_names(lfm3_path, tmp_path):
    """LFM3: the head gates as save_pretrained writes them (self_attn.gate_proj) and as transformers holds them
    (g_proj) load the same weights; the sandwich norms, Qwen3's attention names, the proportional RoPE."""
    published, in_memory, raw = _both_layouts(lfm3_path, tmp_path, "model.layers.2.self_attn.g_proj.weight")
    layer, attn = published.layers[2], published.layers[2].mixer
    assert torch.equal(attn.head_gate.weight, raw["model.layers.2.self_attn.gate_proj.weight"])
    assert torch.equal(attn.o_proj.weight, raw["model.layers.2.self_attn.o_proj.weight"])
    assert torch.equal(layer.post_mixer_norm.weight, raw["model.layers.2.post_operator_norm.weight"])
    assert torch.equal(published.layers[0].post_ffn_norm.weight, raw["model.layers.0.post_ffn_norm.weight"])
    assert (attn.window, published.layers[4].mixer.window) == (0, 6)
    assert torch.count_nonzero(published.rotary.inv_freq) == 16 and published.sliding_rotary.inv_freq.shape == (32,)
    assert torch.equal(prefill_logits(published, IDS), prefill_logits(in_memory, IDS))


def test_zamba2_reads_each_block_once_and_shares_it(zamba2_path, tmp_path):
    """Zamba2: the checkpoint save_pretrained writes (each shared block at the first layer that runs it) and
    transformers' in-memory state dict (a copy at every hybrid layer, as older checkpoints hold them) load the
    same weights; the hybrid layers that run a block borrow its projections (one parameter, named once, as the
    model's ``blocks``), each with adapters of its own read from the block's list at its hybrid index."""
    published, in_memory, raw = _both_layouts(zamba2_path, tmp_path,
                                              "model.layers.5.shared_transformer.self_attn.q_proj.weight")
    first, third = published.layers[1], published.layers[5]  # hybrid layers 0 and 2: block 0
    assert first.attn.qkv_proj is third.attn.qkv_proj is published.blocks[0].qkv_proj
    assert published.layers[3].attn.o_proj is published.blocks[1].o_proj
    assert (first.attn.kv_index, published.layers[3].attn.kv_index, third.attn.kv_index) == (0, 1, 2)
    names = [name for name, _ in published.named_parameters(remove_duplicate=False)]
    assert not any(".attn.qkv_proj." in name or ".attn.o_proj." in name for name in names)
    block = "model.layers.1.shared_transformer"
    q, k = (raw[f"{block}.self_attn.{p}_proj.weight"] for p in "qk")
    assert torch.equal(published.blocks[0].qkv_proj.weight[: q.shape[0]], q)
    assert torch.equal(published.blocks[0].qkv_proj.weight[q.shape[0] : q.shape[0] + k.shape[0]], k)
    assert torch.equal(third.mlp_adapter.up.weight, raw[f"{block}.feed_forward.gate_up_proj_adapter_list.2.1.weight"])
    assert torch.equal(third.attn.adapters[2].down.weight, raw[f"{block}.self_attn.linear_v_adapter_list.2.0.weight"])
    assert torch.equal(third.linear.weight, raw["model.layers.5.linear.weight"])
    assert published.lm_head.weight.data_ptr() == published.embed_tokens.weight.data_ptr()
    assert torch.equal(prefill_logits(published, IDS), prefill_logits(in_memory, IDS))


def test_weights_of_another_checkpoint_are_written_in_place(qwen3_next_dense_path, tiny_ckpt_dir, nemotron_h_path,
                                                            tmp_path):
    """``check_weights`` + ``copy_weights_`` (a weight update): the model computes what the new checkpoint
    loaded afresh computes, every parameter and every derived weight the model cached (``-exp(A_log)``,
    ``1 + w`` of the norms: what a CUDA graph captured reads) at its old address, recomputed."""
    from checkpoints import make_qwen3_next

    from hyla.model.layers import DerivedWeight
    from hyla.model.loader import check_weights, copy_weights_

    new = make_qwen3_next(tiny_ckpt_dir, moe=False, seed=1)  # the same model, other weights
    model = load_model(qwen3_next_dense_path)
    old_logits = prefill_logits(model, IDS)  # caches the derived weights
    derived = [d for m in model.modules() for d in vars(m).values()
               if isinstance(d, DerivedWeight) and d.value is not None]
    assert len(derived) >= 10  # the norms' scales, the Gated DeltaNet layers' -exp(A_log), ...
    addresses = [p.data_ptr() for p in model.parameters()] + [d.value.data_ptr() for d in derived]
    values = [d.value.clone() for d in derived]
    checked = check_weights(new, model)
    assert not checked.mtp.files and torch.equal(prefill_logits(model, IDS), old_logits)  # checked, not written
    copy_weights_(model, checked.specs, checked.tensors.get)
    assert [p.data_ptr() for p in model.parameters()] + [d.value.data_ptr() for d in derived] == addresses
    assert any(not torch.equal(d.value, v) for d, v in zip(derived, values))
    assert torch.equal(prefill_logits(model, IDS), prefill_logits(load_model(new), IDS))
    # another model's checkpoint, or a broken one: ValueError naming why, nothing read into the model
    with pytest.raises(ValueError, match="describes another model"):
        check_weights(nemotron_h_path, model)
    wider = rewrite(qwen3_next_dense_path, tmp_path / "wider", edit_config=lambda c: {**c, "rms_norm_eps": 0.5})
    with pytest.raises(ValueError, match=r"differs in norm_eps"):
        check_weights(wider, model)
    short = rewrite(qwen3_next_dense_path, tmp_path / "short",
                    edit_tensors=lambda t: {k: v[:-1] if k == "model.norm.weight" else v for k, v in t.items()})
    with pytest.raises(ValueError, match="model.norm.weight"):
        check_weights(short, model)


def test_check_weights_reads_no_tensor_data(qwen3_next_dense_path, falcon_h1_short_path, tmp_path, monkeypatch):
    """``check_weights`` finds from the headers alone what loading would: a tensor that gives its parameter
    another shape through its spec (a conv weight squeezed, q/k/v rows stacked into one projection, µP row
    scales folded in: each run on meta tensors), a non-float tensor; a good checkpoint passes. No tensor's
    data is read (every data read raises here)."""
    from hyla.model.loader import TensorReader, check_weights

    model, falcon = load_model(qwen3_next_dense_path), load_model(falcon_h1_short_path)

    def no_data(self, name):
        raise AssertionError(f"tensor data read: {name}")

    monkeypatch.setattr(TensorReader, "get", no_data)
    check_weights(qwen3_next_dense_path, model)
    check_weights(falcon_h1_short_path, falcon)  # (µP row scales: tensors of the specs' own, meta here)
    conv = "model.layers.0.linear_attn.conv1d.weight"  # [C, 1, K] -> conv_weight [C, K]
    k_proj = "model.layers.3.self_attn.k_proj.weight"  # one of the rows stacked into qkv_proj
    mup_in = "model.layers.1.mamba.in_proj.weight"  # [rows, H] times one factor per row

    def shorter(name: str, dim: int):  # the tensor ``name`` one shorter along ``dim``
        return lambda t: {**t, name: t[name].narrow(dim, 0, t[name].shape[dim] - 1).contiguous()}

    for path, edit, parameter, match in [
        (qwen3_next_dense_path, shorter(conv, 2), "layers.0.mixer.conv_weight", "give shape"),
        (qwen3_next_dense_path, shorter(k_proj, 0), "layers.3.mixer.qkv_proj.weight", "give shape"),
        (falcon_h1_short_path, shorter(mup_in, 1), "layers.1.mamba.in_proj.weight", "give shape"),
        # sources that do not combine: rows of another width stacked, row scales for another number of rows
        (qwen3_next_dense_path, shorter(k_proj, 1), "layers.3.mixer.qkv_proj.weight", "do not make"),
        (falcon_h1_short_path, shorter(mup_in, 0), "layers.1.mamba.in_proj.weight", "do not make"),
    ]:
        bad = rewrite(path, tmp_path / "bad", edit_tensors=edit)
        with pytest.raises(ValueError, match=match) as err:
            check_weights(bad, falcon if path == falcon_h1_short_path else model)
        assert parameter in str(err.value), err.value
    norm = "model.norm.weight"
    ints = rewrite(qwen3_next_dense_path, tmp_path / "ints", edit_tensors=lambda t: {**t, norm: t[norm].long()})
    with pytest.raises(ValueError, match=f"'{norm}' is I64"):
        check_weights(ints, model)


def test_pure_ssm_checkpoint_names(mamba_path, falcon_mamba_path, tmp_path):
    """Mamba's older ``backbone.embedding`` name (what HF's ``MambaModel.load_hook`` renames) loads the
    same model; FalconMamba's dt/B/C norms have no weight, in the checkpoint (HF's are non-persistent
    buffers of ones) or in hyla's model."""
    renamed = rewrite(mamba_path, tmp_path / "renamed", edit_tensors=lambda t: {
        k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in t.items()})
    assert "backbone.embedding.weight" in load_file(renamed / "model.safetensors")
    assert torch.equal(prefill_logits(load_model(renamed), IDS), prefill_logits(load_model(mamba_path), IDS))
    assert not any("layernorm" in name for name in load_file(falcon_mamba_path / "model.safetensors"))
    falcon = load_model(falcon_mamba_path)
    assert not any(".norms." in name for name, _ in falcon.named_parameters())
    assert [type(n).__name__ for n in falcon.layers[0].mixer.norms] == ["WeightlessRMSNorm"] * 3
    assert all(n.eps == 1e-6 for n in falcon.layers[0].mixer.norms)
    assert load_model(mamba_path).layers[0].mixer.norms is None


def test_minimax_regroups_qkv_and_needs_no_decay_tables(minimax_path, tmp_path):
    """MiniMax: the lightning layers' qkv_proj rows regrouped from transformers' per-head [q_h | k_h | v_h] to
    [q | k | v]; the decay tables transformers saves as buffers (slope_rate, *_decay) are not read, so a checkpoint
    without them (MiniMax's own) loads the same model; the slopes are each layer's own; experts from w1 / w3 / w2;
    MiniMax's architecture name and config keys load the same weights too."""
    raw = load_file(minimax_path / "model.safetensors")
    model = load_model(minimax_path)
    mixer = model.layers[0].mixer
    h, d = 4, 32
    w = raw["model.layers.0.self_attn.qkv_proj.weight"].view(h, 3, d, -1)
    assert torch.equal(mixer.qkv_proj.weight.view(3, h, d, -1), w.transpose(0, 1))
    assert torch.equal(mixer.neg_slope, -raw["model.layers.0.self_attn.slope_rate"].flatten())
    assert not torch.equal(model.layers[1].mixer.neg_slope, mixer.neg_slope)  # a decay per layer
    moe = model.layers[0].ffn
    e1 = "model.layers.0.block_sparse_moe.experts.1."
    assert torch.equal(moe.w_in[1], torch.cat([raw[e1 + "w1.weight"], raw[e1 + "w3.weight"]]))
    assert torch.equal(moe.w_out[1], raw[e1 + "w2.weight"])

    def minimax_own(config: dict) -> dict:  # MiniMax's names for what transformers calls layer_types and the factors
        own = {"attn_type_list": [int(t == "full_attention") for t in config["layer_types"]]}
        for part, name in (("full_attn", "full_attention"), ("linear_attn", "linear_attention"), ("mlp", "mlp")):
            for which in ("alpha", "beta"):
                own[f"layernorm_{name}_{which}"] = config[f"{part}_{which}_factor"]
        config = {k: v for k, v in config.items() if k != "layer_types" and not k.endswith("_factor")}
        return {**config, **own, "architectures": ["MiniMaxText01ForCausalLM"], "postnorm": True}

    tables = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
    own = load_model(rewrite(minimax_path, tmp_path / "own",
                             lambda t: {k: v for k, v in t.items() if k.rsplit(".", 1)[-1] not in tables}, minimax_own))
    assert torch.equal(prefill_logits(own, IDS), prefill_logits(model, IDS))
    missing = rewrite(minimax_path, tmp_path / "missing",
                      lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.output_gate" not in k})
    with pytest.raises(ValueError, match="output_gate"):
        load_model(missing)
    # a qkv_proj of a row too few: the combine's own message, with where (the checkpoint, the tensor, the parameter)
    short = rewrite(minimax_path, tmp_path / "short", lambda t: {
        **t, "model.layers.0.self_attn.qkv_proj.weight": t["model.layers.0.self_attn.qkv_proj.weight"][1:]})
    with pytest.raises(ValueError, match=r"short.*model\.layers\.0\.self_attn\.qkv_proj\.weight.* do not make "
                                         r"layers\.0\.mixer\.qkv_proj\.weight: qkv_proj .* does not fit 4 heads"):
        load_model(short)
