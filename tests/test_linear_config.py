"""Linear-attention hybrids (Qwen3-Next, Qwen3.5, Kimi-Linear): config parsing, strict refusals,
presets, and conversion of tiny random HF checkpoints in every spelling (no forward pass yet).

Oracles are HF's own: its config classes derive the layer kinds (``full_attention_interval``,
Kimi's 1-based ``linear_attn_config`` lists, ``first_k_dense_replace``) and defaults; its models,
built on the meta device, say which layers are linear or sparse and how many parameters there
are; the converted leaves are compared with the HF model's in-memory parameters rearranged by
``tests.linear_helpers`` (Qwen3-Next's fused projections through HF's own
``fix_query_key_value_ordering``), and the conv taps and Kimi's decay by running HF's modules.
"""

from __future__ import annotations

import copy
import json
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.model.config import ConfigError, Family, LinearKind, ModelConfig
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.presets import load_preset, preset_hf_config
from dayzero.model.weights import abstract_weights, named_leaves, parameter_count
from tests import linear_helpers as L

LINEAR, FULL = "linear_attention", "full_attention"


def _meta_model(config):
    """HF's model of ``config`` on the meta device (no memory, exact parameter shapes)."""
    with torch.device("meta"):
        if isinstance(config, (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5Config)):
            cls = (transformers.Qwen3_5MoeForConditionalGeneration if isinstance(config, transformers.Qwen3_5MoeConfig)
                   else transformers.Qwen3_5ForConditionalGeneration)
            return cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def _hf_text_count(model) -> int:
    """Parameters of the model (a multimodal file's vision tower included), plus the routers'
    selection biases, which HF keeps as buffers."""
    params = sum(p.numel() for p in model.parameters())
    return params + sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))


def _hf_layer_kinds(model) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """(linear?, sparse?) per decoder layer, read off the HF modules themselves."""
    layers = model.get_decoder().layers
    linear = tuple(hasattr(x, "linear_attn") or type(getattr(x, "self_attn", None)).__name__.endswith("DeltaAttention")
                   for x in layers)
    sparse = tuple(type(x.mlp).__name__.endswith(("SparseMoeBlock", "MoE")) for x in layers)
    return linear, sparse


def _check_against_hf(c: ModelConfig, hf_config) -> None:
    """Layer kinds and the parameter count of our config equal those of HF's model."""
    model = _meta_model(hf_config)
    linear, sparse = _hf_layer_kinds(model)
    assert c.linear.layers == linear
    assert tuple(c.is_moe_layer(i) for i in range(c.num_layers)) == sparse
    assert parameter_count(abstract_weights(c)) == _hf_text_count(model)


# ---- parsing HF's own config dicts ----------------------------------------------------------------

HF_CONFIGS = {
    "qwen3_next": L.qwen_next_config,
    "qwen3_next_interval": lambda: L.qwen_next_config(layer_types=None, full_attention_interval=2,
                                                      decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
    "qwen3_next_defaults": transformers.Qwen3NextConfig,
    "qwen3_5_moe": L.qwen35_moe_config,
    "qwen3_5_moe_text": lambda: L.qwen35_moe_config().text_config,
    "qwen3_5_text": L.qwen35_dense_config,
    "qwen3_5": L.qwen35_multimodal_config,
    "kimi_linear": L.kimi_config,
    "kimi_linear_defaults": transformers.KimiLinearConfig,
    "kimi_linear_q_lora": lambda: L.kimi_config(q_lora_rank=12, first_k_dense_replace=0),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_config_dicts_parse_to_hfs_model(name):
    """``to_dict()`` of HF's config classes (what save_pretrained writes) parses to a config whose
    layer kinds and parameter count are those of HF's model built from it."""
    hf = HF_CONFIGS[name]()
    c = parse_hf_config(hf.to_dict())
    text = hf.get_text_config()
    assert c.family is Family(hf.model_type.removesuffix("_text"))
    _check_against_hf(c, hf)
    if c.family is Family.KIMI_LINEAR:
        assert c.linear.kind is LinearKind.KIMI_DELTA and c.mla.nope and c.moe.score_bias
        assert (c.linear.num_v_heads, c.linear.v_head_dim, c.linear.conv_kernel) == (
            text.linear_num_heads, text.linear_head_dim, text.linear_conv_kernel_dim)
        assert (c.moe.routed_scaling, c.moe.renormalize) == (text.routed_scaling_factor, text.norm_topk_prob)
        return
    assert c.linear.kind is LinearKind.GATED_DELTA and c.attn_output_gate and c.norm_weight_offset == 1.0
    lc = c.linear
    assert (lc.num_k_heads, lc.num_v_heads, lc.k_head_dim, lc.v_head_dim, lc.conv_kernel) == (
        text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
        text.linear_value_head_dim, text.linear_conv_kernel_dim)
    rope = text.rope_parameters
    assert (c.rope.theta, c.rope.partial_rotary_factor) == (rope["rope_theta"], rope["partial_rotary_factor"])
    assert c.tie_word_embeddings == hf.tie_word_embeddings
    if c.moe is not None:
        assert c.moe.shared_gate and c.moe.shared_width == text.shared_expert_intermediate_size
        assert c.moe.renormalize == getattr(text, "norm_topk_prob", True)


# The published files (model/presets.py), against HF's reading of the same dicts.
PRESETS = {
    "qwen3-next-80b-a3b": (transformers.Qwen3NextConfig, 80e9),
    "qwen3.5-397b-a17b": (transformers.Qwen3_5MoeConfig, 397e9),
    "kimi-linear-48b-a3b": (transformers.KimiLinearConfig, 48e9),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_parse_as_hf_reads_them(name):
    """Layer kinds (Kimi's 1-based lists, Qwen's full_attention_interval), RoPE and token ids as
    HF's config classes derive them from the published dicts."""
    raw = preset_hf_config(name)
    c, hf = load_preset(name), PRESETS[name][0].from_dict(copy.deepcopy(raw)).get_text_config()
    assert c.linear.layers == tuple(t == LINEAR for t in hf.layer_types)
    if c.family is Family.KIMI_LINEAR:
        assert c.linear.attention_layers == (3, 7, 11, 15, 19, 23, 26) and c.head_dim == hf.qk_rope_head_dim == 64
        assert tuple(c.is_moe_layer(i) for i in range(c.num_layers)) == tuple(k == "sparse" for k in hf.mlp_layer_types)
        assert c.max_position_embeddings == hf.max_position_embeddings == 1048576
    else:
        assert c.linear.attention_layers == tuple(range(3, c.num_layers, 4))
        assert (c.rope.theta, c.rope.partial_rotary_factor) == (hf.rope_parameters["rope_theta"], 0.25)
        assert c.rope.rotary_dim(c.head_dim) == 64
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_are_hfs(name):
    """dayzero's weight tree counts HF's parameters at the preset (meta device; Kimi's selection
    biases are HF buffers; Qwen3.5's vision tower included), and the published totals hold to 3%."""
    cls, published = PRESETS[name]
    model = _meta_model(cls.from_dict(preset_hf_config(name)))
    ours = parameter_count(abstract_weights(load_preset(name)))
    assert ours == _hf_text_count(model)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / published - 1) < 0.03, total


def test_round_trip_through_dayzeros_json():
    for name in HF_CONFIGS:
        c = parse_hf_config(HF_CONFIGS[name]().to_dict())
        assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c, name


# ---- published spellings HF's classes also accept ----------------------------------------------------


def test_kimi_aliases_and_legacy_keys_read_as_hf_reads_them():
    """HF's attribute_map names (num_local_experts, norm_topk_prob, n_group, ...) mean the same as
    the written ones; the published leftover head_dim (72), which HF's modeling never reads, changes nothing."""
    raw = preset_hf_config("kimi-linear-48b-a3b")
    renamed = {{"num_experts": "num_local_experts", "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
                "num_experts_per_token": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
                "model_max_length": "max_position_embeddings"}.get(k, k): v for k, v in raw.items()}
    assert parse_hf_config(renamed) == load_preset("kimi-linear-48b-a3b")
    hf = transformers.KimiLinearConfig.from_dict(renamed)
    assert (hf.num_experts, hf.moe_renormalize) == (256, True)
    assert parse_hf_config({**raw, "head_dim": 128}).head_dim == 64


def test_qwen35_mrope_settings():
    """M-RoPE's sections are kept in the RoPE config (HF's [11, 11, 10] where the file leaves them
    out); HF always interleaves, so mrope_interleaved is accepted only true (tests/test_vision_convert.py
    checks that text-only logits are HF's)."""
    raw = preset_hf_config("qwen3.5-397b-a17b")
    other = copy.deepcopy(raw)
    other["text_config"]["rope_parameters"].update(mrope_section=[16, 8, 8])
    assert parse_hf_config(other).rope.mrope_section == (16, 8, 8)
    del raw["text_config"]["rope_parameters"]["mrope_section"]
    assert parse_hf_config(raw) == load_preset("qwen3.5-397b-a17b")
    assert load_preset("qwen3.5-397b-a17b").rope.mrope_section == (11, 11, 10)
    other["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(ConfigError, match="mrope_interleaved"):
        parse_hf_config(other)


def test_multimodal_top_level_repeats_and_token_ids():
    """A top-level key repeating text_config's is accepted when equal; the top level's token ids
    win; the top level's tie_word_embeddings is what HF ties by (text_config's is not read)."""
    raw = {**preset_hf_config("qwen3.5-397b-a17b"), "hidden_size": 4096, "eos_token_id": 248046}
    c = parse_hf_config(raw)
    assert c.eos_token_ids == (248046,) and c.hidden_size == 4096 and not c.tie_word_embeddings
    tied = _edit(raw, lambda r: r.update(tie_word_embeddings=True))
    assert parse_hf_config(tied).tie_word_embeddings and not tied["text_config"]["tie_word_embeddings"]
    with pytest.raises(ConfigError, match="hidden_size"):
        parse_hf_config({**raw, "hidden_size": 2048})


# ---- refusals ------------------------------------------------------------------------------------------


def _edit(base, edit):
    raw = copy.deepcopy(base)
    edit(raw)
    return raw


def _text(key, value):
    return lambda raw: raw["text_config"].__setitem__(key, value)


def _lac(key, value):
    return lambda raw: raw["linear_attn_config"].__setitem__(key, value)


QWEN_NEXT = L.qwen_next_config().to_dict()
QWEN35 = L.qwen35_moe_config().to_dict()
KIMI = L.kimi_config().to_dict()
REFUSED = {
    "next_unknown_key": (QWEN_NEXT, lambda r: r.update(some_new_key=1), "some_new_key"),
    "next_layer_types_length": (QWEN_NEXT, lambda r: r.update(layer_types=[LINEAR, FULL, LINEAR]), "layer_types"),
    "next_layer_kind": (QWEN_NEXT, lambda r: r.update(layer_types=[LINEAR, "sliding_attention"] * 2), "layer_types"),
    "next_all_linear": (QWEN_NEXT, lambda r: r.update(layer_types=[LINEAR] * 4), "no 'full_attention' layer"),
    "next_interval_disagrees": (QWEN_NEXT, lambda r: r.update(full_attention_interval=4), "full_attention_interval"),
    "next_value_heads": (QWEN_NEXT, lambda r: r.update(linear_num_value_heads=3),
                         "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    "next_attention_bias": (QWEN_NEXT, lambda r: r.update(attention_bias=True), "attention_bias"),
    "next_sliding_window": (QWEN_NEXT, lambda r: r.update(sliding_window=4096), "sliding_window"),
    "next_mrope": (QWEN_NEXT, lambda r: r["rope_parameters"].update(mrope_section=[1, 1, 2]), "mrope_section"),
    "next_mlp_only_layers": (QWEN_NEXT, lambda r: r.update(mlp_only_layers=[9]), "mlp_only_layers"),
    "next_no_shared_width": (QWEN_NEXT, lambda r: r.update(shared_expert_intermediate_size=0),
                             "shared_expert_intermediate_size"),
    "next_partial_rotary": (QWEN_NEXT, lambda r: r.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "next_mxfp4": (QWEN_NEXT, lambda r: r.update(quantization_config={"quant_method": "mxfp4"}), "mxfp4"),
    "qwen35_top_unknown": (QWEN35, lambda r: r.update(some_new_key=1), "some_new_key"),
    "qwen35_text_unknown": (QWEN35, _text("some_new_key", 1), "text_config: .*some_new_key"),
    "qwen35_renormalize": (QWEN35, _text("norm_topk_prob", False), "norm_topk_prob"),
    "qwen35_output_gate": (QWEN35, _text("attn_output_gate", False), "attn_output_gate"),
    "qwen35_gate_type": (QWEN35, _text("output_gate_type", "sigmoid"), "output_gate_type"),
    "qwen35_text_type": (QWEN35, _text("model_type", "qwen3_5_text"), "qwen3_5_text"),
    "qwen35_no_text": (QWEN35, lambda r: r.pop("text_config"), "no text_config"),
    "qwen35_text_quant": (QWEN35, _text("quantization_config", {"quant_method": "fp8"}), "quantization_config"),
    "kimi_unknown_key": (KIMI, lambda r: r.update(some_new_key=1), "some_new_key"),
    "kimi_lac_unknown": (KIMI, _lac("gate_lower_bound", -5.0), "gate_lower_bound"),
    "kimi_one_list": (KIMI, lambda r: r.update(layer_types=None) or r["linear_attn_config"].pop("full_attn_layers"),
                      "give both"),
    "kimi_zero_based": (KIMI, lambda r: r.update(layer_types=None) or _lac("kda_layers", [0, 2])(r), "1-based"),
    "kimi_overlap": (KIMI, lambda r: r.update(layer_types=None) or _lac("kda_layers", [1, 2, 3])(r), "exactly one"),
    "kimi_lists_disagree": (KIMI, lambda r: r["linear_attn_config"].update(kda_layers=[2, 3], full_attn_layers=[1]),
                            "disagree"),
    "kimi_alias_disagrees": (KIMI, lambda r: r.update(num_local_experts=8), "num_local_experts"),
    "kimi_heads_disagree": (KIMI, lambda r: r.update(linear_num_heads=4), "linear_num_heads"),
    "kimi_rope": (KIMI, lambda r: r.update(mla_use_nope=False), "mla_use_nope"),
    "kimi_rope_scaling": (KIMI, lambda r: r.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    "kimi_router": (KIMI, lambda r: r.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    "kimi_mlp_types": (KIMI, lambda r: r.update(mlp_layer_types=["sparse"] * 3), "first_k_dense_replace"),
    "kimi_no_shared": (KIMI, lambda r: r.update(num_shared_experts=0), "num_shared_experts"),
    "kimi_moe_layer_freq": (KIMI, lambda r: r.update(moe_layer_freq=2), "moe_layer_freq"),
    "kimi_kv_heads": (KIMI, lambda r: r.update(num_key_value_heads=1), "num_key_value_heads"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_name_the_key(name):
    base, edit, match = REFUSED[name]
    raw = _edit(base, edit)
    parse_hf_config(base)  # the unedited dict is fine
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(raw)


# ---- conversion -----------------------------------------------------------------------------------------


def _convert(model, root, save=None, tensors_edit=None, config_edit=None):
    """``save_pretrained`` (``save``: its keyword arguments) into root/hf, the checkpoint edited
    in place, converted to root/dz and loaded in fp32; returns ``(config, {leaf: array})``."""
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir, **(save or {}))
    if tensors_edit or config_edit:
        L.edit_checkpoint(hf_dir, tensors_edit, config_edit)
    convert_checkpoint(hf_dir, root / "dz", progress=False)
    config, weights = load_checkpoint(root / "dz", dtype=jnp.float32)
    return config, {k: np.asarray(v) for k, v in named_leaves(weights).items()}


def _assert_leaves(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def _kimi_published(tensors):
    """The published Kimi-Linear names the dense layer's MLP ``mlp.``, where HF 5.24 writes
    ``block_sparse_moe.`` for every layer."""
    for name in [n for n in tensors if n.startswith("model.layers.0.block_sparse_moe.")]:
        tensors[name.replace(".block_sparse_moe.", ".mlp.")] = tensors.pop(name)


# (config factory, save_pretrained keyword arguments, checkpoint edit, expected leaves)
CASES = {
    # Published Qwen3-Next (per-expert) is what save_pretrained writes.
    "qwen3_next": (L.qwen_next_config, {}, None, L.expected_qwen),
    "qwen3_next_fused": (L.qwen_next_config, {"save_original_format": False}, None, L.expected_qwen),
    # Published Qwen3.5 bf16: model.language_model.*, fused experts, the vision tower beside.
    "qwen3_5_moe_published": (L.qwen35_moe_config, {"save_original_format": False}, None, L.expected_qwen),
    "qwen3_5_moe_per_expert": (L.qwen35_moe_config, {}, None, L.expected_qwen),
    "qwen3_5_moe_text": (lambda: L.qwen35_moe_config().text_config, {}, None, L.expected_qwen),
    "qwen3_5_text": (L.qwen35_dense_config, {}, None, L.expected_qwen),
    "qwen3_5_multimodal_tied": (L.qwen35_multimodal_config, {}, None, L.expected_qwen),
    "kimi_published": (L.kimi_config, {}, _kimi_published, L.expected_kimi),
    "kimi_saved": (L.kimi_config, {}, None, L.expected_kimi),
    "kimi_in_memory": (L.kimi_config, {"save_original_format": False}, None, L.expected_kimi),
    "kimi_q_lora": (lambda: L.kimi_config(q_lora_rank=12), {}, None, L.expected_kimi),
}
FAST = ("qwen3_next", "qwen3_5_moe_published", "qwen3_5_text", "kimi_published")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_converted_leaves_are_hfs_parameters(name, tmp_path):
    """Every leaf of the converted tiny model equals the HF parameter it comes from (fp32, bit for
    bit), whichever spelling the checkpoint uses."""
    factory, save, edit, expected = CASES[name]
    model = L.random_model(factory())
    _, got = _convert(model, tmp_path, save, edit)
    # A multimodal file's vision tower: tests/test_vision_convert.py (against HF's tower outputs).
    _assert_leaves({k: v for k, v in got.items() if not k.startswith("vision/")}, expected(model))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Qwen3-Next and a tiny Kimi-Linear (HF model, converted leaves), converted once."""
    out = {}
    for name, config in (("qwen3_next", L.qwen_next_config()), ("kimi", L.kimi_config())):
        model = L.random_model(config, seed=1)
        out[name] = (model, _convert(model, tmp_path_factory.mktemp(name))[1])
    return out


def _causal_conv(x: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution of x [T, C] by taps [W, C], oldest tap first."""
    W, T = taps.shape[0], x.shape[0]
    padded = np.concatenate([np.zeros((W - 1, x.shape[1]), x.dtype), x])
    return sum(taps[j] * padded[j:j + T] for j in range(W))


@pytest.mark.parametrize("name", ["qwen3_next", "kimi"])
def test_conv_taps_convolve_as_hfs_conv1d(converted, name):
    """Our [W, heads, dim] taps, applied oldest first to the q|k|v channels, give HF's causal
    depthwise Conv1d output (the layer's own module, before its activation)."""
    model, leaves = converted[name]
    layer = model.get_decoder().layers[0]
    conv = layer.linear_attn.conv1d if name == "qwen3_next" else layer.self_attn.conv1d
    T = 7
    x = np.random.default_rng(0).standard_normal((T, conv.in_channels)).astype(np.float32)
    with torch.no_grad():
        ref = conv(torch.from_numpy(x.T[None]))[0, :, :T].numpy().T
    taps = np.concatenate([leaves[f"layers/0/attn/conv_{p}"].reshape(conv.kernel_size[0], -1) for p in "qkv"], 1)
    np.testing.assert_allclose(_causal_conv(x, taps), ref, rtol=1e-5, atol=1e-5)


def test_kimi_decay_leaves_give_hfs_forget_gate(converted):
    """g = -exp(A_log) * softplus(x . decay_a . decay_b + dt_bias) per head and channel, from our
    leaves, is HF's KimiLinearForgetGate output (checks the [H, d] layouts of dt_bias and decay_b)."""
    model, leaves = converted["kimi"]
    gate = model.model.layers[0].self_attn.forget_gate
    x = np.random.default_rng(1).standard_normal((1, 5, model.config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = gate(torch.from_numpy(x)).numpy()
    t = "layers/0/attn/"
    pre = np.einsum("btd,de,ehk->bthk", x, leaves[t + "decay_a"], leaves[t + "decay_b"]) + leaves[t + "dt_bias"]
    ours = -np.exp(leaves[t + "A_log"])[:, None] * np.logaddexp(0, pre)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def _fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block FP8 by hand (scale_inv = max|block| / 448): (values, scale_inv, the exact dequantized weight)."""
    bo, bi = block
    rows, cols = math.ceil(w.shape[0] / bo), math.ceil(w.shape[1] / bi)
    padded = np.zeros((rows * bo, cols * bi), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.reshape(rows, bo, cols, bi)
    scale_inv = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    q = (blocks / scale_inv[:, None, :, None]).astype(ml_dtypes.float8_e4m3fn)
    exact = (q.astype(np.float32) * scale_inv[:, None, :, None]).reshape(padded.shape)[: w.shape[0], : w.shape[1]]
    values = np.ascontiguousarray(q.reshape(padded.shape)[: w.shape[0], : w.shape[1]])
    return values, scale_inv.astype(np.float32), exact


def test_fp8_qwen3_next_converts_to_the_dequantized_weights(tmp_path):
    """Qwen3-Next-80B-A3B-Instruct-FP8's scheme (float8_e4m3fn projections with weight_scale_inv
    blocks, routers, shared_expert_gate, conv and norms unquantized; quantization_config with
    modules_to_not_convert): the converted leaves are those of the exactly dequantized checkpoint.
    Blocks of 16 x 24 give the tiny projections several blocks, partial ones included."""
    model, block = L.random_model(L.qwen_next_config(), seed=2), (16, 24)

    def quantize(tensors, reference):
        for name in [n for n, t in tensors.items() if "_proj" in n and n.endswith(".weight") and t.ndim == 2]:
            q, scale_inv, exact = _fp8(tensors[name].numpy(), block)
            tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv)
            reference[name] = torch.from_numpy(np.ascontiguousarray(exact))

    def fp8_config(raw):
        raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(block),
                                      "modules_to_not_convert": ["lm_head", "model.layers.0.linear_attn.conv1d"]}

    reference = {}
    _, fp8_leaves = _convert(model, tmp_path / "fp8", tensors_edit=lambda t: quantize(t, reference),
                             config_edit=fp8_config)
    assert any(n.endswith("in_proj_qkvz.weight") for n in reference) and len(reference) > 20
    _, exact_leaves = _convert(model, tmp_path / "exact", tensors_edit=lambda t: t.update(reference))
    _assert_leaves(fp8_leaves, exact_leaves)
    assert not np.array_equal(exact_leaves["layers/0/attn/q"], L.expected_qwen(model)["layers/0/attn/q"])


def test_checkpoint_problems_are_named(tmp_path):
    """A missing tensor and an unknown one are named (the MTP module is skipped by name, anything
    else beside it is not)."""
    model = L.random_model(L.qwen35_moe_config())
    model.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    missing = "model.language_model.layers.0.linear_attn.conv1d.weight"
    for name, edit in ((missing, lambda t: t.pop(missing)),
                       ("model.language_model.layers.0.linear_attn.extra",
                        lambda t: t.update({"model.language_model.layers.0.linear_attn.extra": torch.zeros(2)}))):
        edited = dict(tensors)
        edit(edited)
        edited["mtp.fc.weight"] = torch.zeros(2, 2)  # always skipped, as HF skips it
        save_file(edited, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConvertError, match=name.replace(".", r"\.")):
            convert_checkpoint(tmp_path / "hf", tmp_path / "dz", progress=False)
