"""DeepSeek-V4 config parsing, presets, checkpoint names and ``dayzero check`` (no forward pass).

The oracle is HF's own code: ``DeepseekV4Config`` folds the legacy keys and fills the defaults
(its ``to_dict()`` is the nested form, parsed to the same ``ModelConfig`` as the flat file it came
from), ``DeepseekV4RotaryEmbedding`` gives the RoPE frequencies and scale, a meta-device
``DeepseekV4ForCausalLM`` gives the parameter counts, and the tiny model's ``state_dict()`` gives
the tensors each converted leaf must equal under its documented layout.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.convert.check import check
from dayzero.model.config import (
    AttentionKind, CompressedConfig, CompressKind, ConfigError, Family, HyperConfig, ModelConfig, MoEConfig,
    RopeConfig, RopeType, RouterScore,
)
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.presets import load_preset, preset_hf_config
from dayzero.model.rope import static_inv_freq, yarn_attention_factor
from dayzero.model.weights import abstract_weights, named_leaves, parameter_count
from tests.v4_helpers import TINY, tiny_hf_config, tiny_hf_model

SLIDING, CSA, HCA = CompressKind.SLIDING, CompressKind.CSA, CompressKind.HCA


def _hf_dict(raw: dict) -> dict:
    """What HF makes of a config dict: ``DeepseekV4Config(**raw).to_dict()`` (nested RoPE form)."""
    # A deep copy: HF's config keeps (and fills in) the very rope dicts it is given.
    return transformers.DeepseekV4Config(**copy.deepcopy({k: v for k, v in raw.items() if k != "model_type"})).to_dict()


def _assert_fields_equal(got: ModelConfig, want: ModelConfig) -> None:
    for f in dataclasses.fields(ModelConfig):
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got == want


# ---- parsing ------------------------------------------------------------------------------------------


def test_tiny_config_parses_to_the_expected_model_config():
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=0.25)
    want = ModelConfig(
        family=Family.DEEPSEEK_V4, vocab_size=256, hidden_size=64, intermediate_size=32, num_layers=4, num_heads=4,
        num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=4096, rope=rope,
        sliding_windows=(16,) * 4, attention_sinks=True, bos_token_id=0, eos_token_ids=(1,),
        moe=MoEConfig(num_experts=8, experts_per_token=2, intermediate_size=32, layers=(True,) * 4,
                      score=RouterScore.SQRTSOFTPLUS, renormalize=True, score_bias=True, routed_scaling=1.5,
                      shared_experts=1, swiglu_limit=10.0, hash_layers=(True, True, False, False)),
        attention=AttentionKind.COMPRESSED, mtp_layers=0,
        compressed=CompressedConfig(kinds=(SLIDING, CSA, HCA, CSA), window=16,
                                    compress_rope=dataclasses.replace(rope, theta=160000.0), q_lora_rank=32,
                                    o_groups=2, o_lora_rank=16, index_topk=8, index_heads=16, index_head_dim=32,
                                    csa_ratio=4, hca_ratio=16),
        hyper=HyperConfig(mult=4, sinkhorn_iters=20, eps=1e-6),
    )
    got = parse_hf_config(tiny_hf_config().to_dict())
    _assert_fields_equal(got, want)
    assert ModelConfig.from_json(json.loads(json.dumps(got.to_json()))) == got  # what convert writes and reads


def test_published_flash_config_parses_to_the_expected_model_config():
    """The published (flat, legacy-keyed) config.json: sliding layers 0-1, then CSA / HCA; the
    compress rope is YaRN x16 over 65536 at theta 160000 with attention factor 1; the MTP entry
    of compress_ratios is dropped. HF's folding of the same file parses identically."""
    raw = preset_hf_config("deepseek-v4-flash")
    main = RopeConfig(theta=10000.0, partial_rotary_factor=0.125)
    compress = RopeConfig(type=RopeType.YARN, theta=160000.0, factor=16, original_max_position=65536,
                          beta_fast=32, beta_slow=1, attention_factor=1.0, partial_rotary_factor=0.125)
    L = 43
    want = ModelConfig(
        family=Family.DEEPSEEK_V4, vocab_size=129280, hidden_size=4096, intermediate_size=2048, num_layers=L,
        num_heads=64, num_kv_heads=1, head_dim=512, rms_norm_eps=1e-6, max_position_embeddings=1048576, rope=main,
        sliding_windows=(128,) * L, attention_sinks=True, bos_token_id=0, eos_token_ids=(1,),
        moe=MoEConfig(num_experts=256, experts_per_token=6, intermediate_size=2048, layers=(True,) * L,
                      score=RouterScore.SQRTSOFTPLUS, renormalize=True, score_bias=True, routed_scaling=1.5,
                      shared_experts=1, swiglu_limit=10.0, hash_layers=(True,) * 3 + (False,) * (L - 3)),
        attention=AttentionKind.COMPRESSED, mtp_layers=1,
        compressed=CompressedConfig(kinds=(SLIDING, SLIDING) + (CSA, HCA) * 20 + (CSA,), window=128,
                                    compress_rope=compress, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                                    index_topk=512, index_heads=64, index_head_dim=128, csa_ratio=4, hca_ratio=128),
        hyper=HyperConfig(mult=4, sinkhorn_iters=20, eps=1e-6),
    )
    _assert_fields_equal(parse_hf_config(raw), want)
    _assert_fields_equal(parse_hf_config(_hf_dict(raw)), want)


def test_omitted_keys_take_hfs_defaults():
    defaults = parse_hf_config({"model_type": "deepseek_v4"})
    assert defaults == parse_hf_config(transformers.DeepseekV4Config().to_dict())
    # HF's default layer kinds: two HCA, then HCA / CSA alternating from HCA; three hash layers.
    assert defaults.compressed.kinds[:5] == (HCA, HCA, HCA, CSA, HCA)
    assert defaults.moe.hash_layers == (True,) * 3 + (False,) * 40


# A small config without the modern keys, so each legacy spelling below can be added alone.
_BASE = {k: v for k, v in TINY.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types",
                                                    "partial_rotary_factor")}
_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 1024, "type": "yarn"}


@pytest.mark.parametrize("legacy", [
    {"compress_ratios": [0, 4, 128, 4, 0]},  # L + 1 entries: the last is the MTP layer's
    {"compress_ratios": [128, 128, 4, 128]},
    {"compress_rate_csa": 8, "compress_rate_hca": 32},
    {"compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 8}},
    {"num_hash_layers": 1},
    {"num_hash_layers": 0},
    {"qk_rope_head_dim": 32},
    {"partial_rotary_factor": 0.5, "qk_rope_head_dim": 32},
    {"rope_scaling": _YARN, "compress_rope_theta": 50000, "rope_theta": 5000},
    {"rope_parameters": {**_YARN, "type": None, "rope_type": "yarn", "attention_factor": 1.2}},
    {"rope_parameters": {"rope_type": "default"}},
    {"intermediate_size": 32, "moe_intermediate_size": None, "num_local_experts": 8, "n_routed_experts": None},
])
def test_legacy_keys_fold_in_as_hf_folds_them(legacy):
    """Each legacy spelling parses to what HF makes of it (its to_dict, the nested form)."""
    raw = {**_BASE, **{k: v for k, v in legacy.items() if v is not None}, "model_type": "deepseek_v4"}
    for key in ("moe_intermediate_size", "n_routed_experts"):
        if key in legacy and legacy[key] is None:
            del raw[key]
    if isinstance(raw.get("rope_parameters"), dict):
        raw["rope_parameters"] = {k: v for k, v in raw["rope_parameters"].items() if v is not None}
    assert parse_hf_config(raw) == parse_hf_config(_hf_dict(raw))


def test_legacy_keys_mean_what_they_say():
    parsed = parse_hf_config({**_BASE, "model_type": "deepseek_v4", "compress_ratios": [0, 4, 128, 4, 0],
                              "num_hash_layers": 1, "qk_rope_head_dim": 32, "rope_scaling": _YARN})
    assert parsed.compressed.kinds == (SLIDING, CSA, HCA, CSA) and parsed.moe.hash_layers == (True, False, False, False)
    assert parsed.rope.partial_rotary_factor == 0.5 and parsed.rope.type is RopeType.DEFAULT
    compress = parsed.compressed.compress_rope
    assert compress.type is RopeType.YARN and compress.attention_factor == 1.0


# Keys HF never reads: accepted and ignored (each has its reason in hf_config_v4._IGNORED_V4).
_IGNORED = {"norm_topk_prob": False, "topk_method": "greedy", "first_k_dense_replace": 3, "qk_nope_head_dim": 448,
            "kv_lora_rank": 512, "rope_interleave": True, "expert_dtype": "fp4", "router_aux_loss_coef": 0.5,
            "router_jitter_noise": 0.1, "output_router_logits": True, "topk_group": 4, "n_group": 1,
            "num_key_value_heads": None, "aux_loss_alpha": 0.001}


def test_keys_hf_never_reads_are_ignored():
    base = tiny_hf_config().to_dict()
    assert parse_hf_config({**base, **_IGNORED}) == parse_hf_config(base)


@pytest.mark.parametrize("change, key", [
    ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"n_group": 8}, "n_group"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
    ({"mlp_layer_types": ["moe"] * 4, "num_hash_layers": 1}, "num_hash_layers"),
    ({"compress_ratios": [0, 4, 64, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 4, 128, 4]}, "compress_ratios"),  # 128 but the tiny HCA rate is 16
    ({"compress_ratios": [0, 4, 16, 4], "compress_rates": None}, "compress_ratios"),
    ({"compress_rates": {"compressed_sparse_attention": 4}}, "compress_rates"),
    ({"compress_rate_hca": 8}, "compress_rate_hca"),
    ({"qk_rope_head_dim": 32}, "qk_rope_head_dim"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"compress_rope_theta": 1e5}, "compress_rope_theta"),
    ({"rope_theta": 1e5}, "rope_theta"),
    ({"rope_scaling": _YARN}, "rope_scaling"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "default"}},
      "partial_rotary_factor": None}, "partial_rotary_factor"),
    ({"rope_parameters": {"main": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}}, "rope_parameters"),
    ({"rope_parameters": {"main": {"rope_theta": 1e4, "partial_rotary_factor": 0.25},
                          "compress": {**_YARN, "partial_rotary_factor": 0.25, "rope_theta": 1.6e5,
                                       "truncate": False}}}, "truncate"),
    ({"o_groups": 3}, "o_groups"),
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"intermediate_size": 64}, "intermediate_size"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "quantization_config"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"use_mystery_feature": True}, "use_mystery_feature"),
])
def test_unsupported_values_are_refused_naming_the_key(change, key):
    raw = {k: v for k, v in {**tiny_hf_config().to_dict(), **change}.items() if v is not None}  # None: key removed
    with pytest.raises(ConfigError) as info:
        parse_hf_config(raw)
    message = str(info.value)
    assert key in message and len(message.splitlines()) == 1, message


def test_published_quantization_is_accepted_for_plan():
    quant = preset_hf_config("deepseek-v4-flash")["quantization_config"]
    base = tiny_hf_config().to_dict()
    parsed = parse_hf_config(base)
    assert parse_hf_config({**base, "quantization_config": quant}) == parsed
    # V4.1 moves expert_dtype into the quantization_config.
    assert parse_hf_config({**base, "quantization_config": {**quant, "expert_dtype": "fp4"}}) == parsed


def test_ropes_match_hfs_rotary_embedding():
    """Frequencies and cos/sin scale of both ropes against HF's DeepseekV4RotaryEmbedding, for the
    published Flash config (YaRN compress rope, attention factor forced to 1)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = preset_hf_config("deepseek-v4-flash")
    config = parse_hf_config(raw)
    hf = DeepseekV4RotaryEmbedding(transformers.DeepseekV4Config(**raw))
    for label, rope in (("main", config.rope), ("compress", config.compressed.compress_rope)):
        np.testing.assert_allclose(static_inv_freq(rope, config.head_dim), getattr(hf, f"{label}_inv_freq").numpy(),
                                   rtol=1e-6, err_msg=label)
        scale = yarn_attention_factor(rope) if rope.type is RopeType.YARN else 1.0
        assert scale == getattr(hf, f"{label}_attention_scaling"), label
    assert hf.compress_attention_scaling == 1.0
    # Without the forced factor YaRN would scale cos/sin by 0.1 ln 16 + 1: the check above can fail.
    unforced = dataclasses.replace(config.compressed.compress_rope, attention_factor=None)
    assert abs(yarn_attention_factor(unforced) - 1.277) < 1e-3


# ---- presets and the planner --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_preset_parameter_count_is_hfs(name):
    """dayzero's weight tree counts HF's parameters (meta device) plus the two buffers HF does not
    count as parameters but the converter stores as leaves (each top-k layer's
    e_score_correction_bias [E] and each hash layer's tid2eid [V,C]) and the MTP layer, which HF
    does not build but dayzero keeps."""
    raw = preset_hf_config(name)
    hf_config = transformers.DeepseekV4Config(**raw)
    assert parse_hf_config(hf_config.to_dict()) == load_preset(name)
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(hf_config)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "tid2eid")))
    config = load_preset(name)
    E, V, C, L = raw["n_routed_experts"], raw["vocab_size"], raw["num_experts_per_tok"], raw["num_hidden_layers"]
    assert buffers == (L - 3) * E + 3 * V * C
    mtp = parameter_count(abstract_weights(config).mtp)
    assert mtp > 0 and config.mtp_layers == 1
    assert parameter_count(abstract_weights(config)) == sum(p.numel() for p in model.parameters()) + buffers + mtp
    assert DecodeFootprint(config, name).parameters == parameter_count(abstract_weights(config))


# ---- checkpoint names and dtypes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(seed=1)


def _expected(sd: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    """The dayzero leaves HF's state dict (its in-memory names) becomes, written out by hand."""
    t = {k: v.numpy() for k, v in sd.items()}
    cc, N, H = config.compressed, config.num_heads, config.head_dim
    g, F = cc.o_groups, config.moe.intermediate_size
    out = {"embed": t["model.embed_tokens.weight"], "final_norm": t["model.norm.weight"],
           "lm_head": t["lm_head.weight"].T}
    out.update({f"hc_head/{p}": t[f"model.hc_head.hc_{p}"] for p in ("fn", "base", "scale")})
    for i in range(config.num_layers):
        p, q = f"model.layers.{i}.", f"layers/{i}/"
        a, m = p + "self_attn.", p + "mlp."
        out[q + "attn_norm"] = t[p + "input_layernorm.weight"]
        out[q + "mlp_norm"] = t[p + "post_attention_layernorm.weight"]
        for mix, hc in (("attn_hc", "attn_hc"), ("mlp_hc", "ffn_hc")):
            out.update({f"{q}{mix}/{x}": t[f"{p}{hc}.{x}"] for x in ("fn", "base", "scale")})
        out[q + "attn/q_a"] = t[a + "q_a_proj.weight"].T
        out[q + "attn/q_a_norm"] = t[a + "q_a_norm.weight"]
        out[q + "attn/q_b"] = t[a + "q_b_proj.weight"].T.reshape(-1, N, H)
        out[q + "attn/kv"] = t[a + "kv_proj.weight"].T
        out[q + "attn/kv_norm"] = t[a + "kv_norm.weight"]
        w = t[a + "o_a_proj.weight"]  # [g*d_g, N*H/g] -> [g, N*H/g, d_g]
        out[q + "attn/o_a"] = np.stack([w[k * cc.o_lora_rank:(k + 1) * cc.o_lora_rank].T for k in range(g)])
        out[q + "attn/o_b"] = t[a + "o_b_proj.weight"].T
        out[q + "attn/sinks"] = t[a + "sinks"]
        compressors = {"compressor/": a + "compressor."} if cc.ratio(i) else {}
        if cc.kinds[i] is CSA:
            compressors["indexer/compressor/"] = a + "compressor.indexer."
            I, J = cc.index_heads, cc.index_head_dim
            out[q + "attn/indexer/q_b"] = t[a + "compressor.indexer.q_b_proj.weight"].T.reshape(-1, I, J)
            out[q + "attn/indexer/head_weights"] = t[a + "compressor.indexer.scorer.weights_proj.weight"].T
        for leaf, src in compressors.items():
            out[q + "attn/" + leaf + "kv"] = t[src + "kv_proj.weight"].T
            out[q + "attn/" + leaf + "gate"] = t[src + "gate_proj.weight"].T
            out[q + "attn/" + leaf + "position_bias"] = t[src + "position_bias"]
            out[q + "attn/" + leaf + "norm"] = t[src + "kv_norm.weight"]
        out[q + "mlp/router"] = t[m + "gate.weight"].T
        if config.moe.hash_layers[i]:
            out[q + "mlp/tid2eid"] = t[m + "gate.tid2eid"].astype(np.int32)
        else:
            out[q + "mlp/score_bias"] = t[m + "gate.e_score_correction_bias"]
        gate_up = t[m + "experts.gate_up_proj"]  # [E, 2F, D], gate rows first
        out[q + "mlp/gate"] = gate_up[:, :F].transpose(0, 2, 1)
        out[q + "mlp/up"] = gate_up[:, F:].transpose(0, 2, 1)
        out[q + "mlp/down"] = t[m + "experts.down_proj"].transpose(0, 2, 1)
        for leaf in ("gate", "up", "down"):
            out[q + f"mlp/shared/{leaf}"] = t[m + f"shared_experts.{leaf}_proj.weight"].T
    return out


def _upstream_name(name: str) -> str:
    """save_pretrained's name -> DeepSeek's own (the published checkpoints' spelling)."""
    name = name.replace("model.hc_head.hc_", "hc_head_").replace(".attn.norm.", ".attn.kv_norm.")
    return {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(
        name, name.removeprefix("model."))


def _save(model, path, spelling: str):
    """The tiny model in one of the three spellings the converter reads."""
    model.save_pretrained(path, safe_serialization=True, save_original_format=spelling != "hf")
    if spelling == "upstream":
        f = path / "model.safetensors"
        tensors = load_file(f)
        save_file({_upstream_name(k): v for k, v in tensors.items()}, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    """{spelling: (source dir, converted dir)}, each converted once."""
    out = {}
    for spelling in ("saved", "hf", "upstream"):
        root = tmp_path_factory.mktemp(spelling)
        src = _save(hf_model, root / "hf", spelling)
        out[spelling] = src, convert_checkpoint(src, root / "dz", progress=False)
    return out


@pytest.mark.parametrize("spelling", ["saved", "hf", "upstream"])
def test_converted_leaves_are_hfs_tensors(hf_model, converted, spelling):
    """Every leaf equals HF's tensor under its documented layout, bit for bit; tid2eid is int32,
    the sinks, position biases and hyper-connection mixes float32."""
    src, dst = converted[spelling]
    config, weights = load_checkpoint(dst)
    assert config == parse_hf_config(tiny_hf_config().to_dict())
    got = {k: np.asarray(v) for k, v in named_leaves(weights).items()}
    want = _expected(hf_model.state_dict(), config)
    assert sorted(got) == sorted(want) == sorted(named_leaves(abstract_weights(config)))
    for name, value in want.items():
        assert got[name].dtype == (np.int32 if name.endswith("tid2eid") else np.float32), name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    hashed = got["layers/0/mlp/tid2eid"]
    assert hashed.min() >= 0 and hashed.max() < 8 and len(np.unique(hashed)) > 2  # the randomised table


def test_fixed_dtypes_survive_a_bfloat16_conversion(converted, tmp_path):
    src, _ = converted["saved"]
    dst = convert_checkpoint(src, tmp_path / "dz", dtype="bfloat16", progress=False)
    tensors = json.loads((dst / "manifest.json").read_text())["tensors"]
    assert tensors["layers/0/mlp/tid2eid"]["dtype"] == "int32"
    for leaf in ("layers/0/attn/sinks", "layers/1/attn/compressor/position_bias", "layers/2/attn_hc/fn",
                 "hc_head/scale"):
        assert tensors[leaf]["dtype"] == "float32", leaf
    assert tensors["layers/0/attn/q_a"]["dtype"] == "bfloat16"
    assert check(dst).passed  # each stored dtype is what the manifest says
    _, weights = load_checkpoint(dst, dtype=jnp.bfloat16)
    layer = weights.layers[0]
    assert layer.mlp.tid2eid.dtype == jnp.int32 and layer.attn.sinks.dtype == jnp.float32
    assert layer.attn_hc.fn.dtype == jnp.float32 and layer.attn.q_a.dtype == jnp.bfloat16


def test_check_reports_no_unknown_tensors_and_refuses_undeclared_mtp(converted, tmp_path):
    for spelling, (src, _) in converted.items():
        report = check(src)
        assert report.passed, (spelling, report.all_problems)
        s = report.structure
        assert s["missing"] == s["unexpected"] == s["wrong_shape"] == s["not_float"] == s["ignored"] == [], spelling
    # MTP tensors in a checkpoint that declares no MTP layer are unexpected (the kept MTP layer
    # itself is checked in tests/test_v4_formats.py).
    src = converted["upstream"][0]
    root = tmp_path / "mtp"
    root.mkdir()
    mtp = {"mtp.0.attn.wq_a.weight": torch.zeros(32, 64), "mtp.0.hc_head_fn": torch.zeros(4, 256)}
    save_file({**load_file(src / "model.safetensors"), **mtp}, root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text((src / "config.json").read_text())  # no MTP layer declared
    assert check(root).structure["unexpected"] == ["mtp.0.attn.wq_a.weight", "mtp.0.hc_head_fn"]


def test_unknown_expert_dtype_is_refused_before_reading(converted, tmp_path):
    """The published FP8 weights and FP4 experts convert (tests/test_v4_formats.py); an expert
    format dayzero does not read is one line before any tensor is read."""
    src = converted["saved"][0]
    root = tmp_path / "published"
    root.mkdir()
    (root / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    config = json.loads((src / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "expert_dtype": "int4"}))
    with pytest.raises(ConvertError, match="expert_dtype") as info:
        convert_checkpoint(root, tmp_path / "dz", progress=False)
    assert len(str(info.value).splitlines()) == 1
