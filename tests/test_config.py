"""Strict parsing of HF ``config.json`` and the RoPE frequency schemes (against transformers)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dayzero.model.config import ConfigError, Family, ModelConfig, RopeConfig, RopeType

from dayzero.model.hf_config import load_hf_config, parse_hf_config
from dayzero.model.rope import rope_cos_sin, static_inv_freq, yarn_attention_factor

BASE = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
}


def _cfg(**changes) -> dict:
    out = {**BASE, **changes}
    return {k: v for k, v in out.items() if v is not None}


# ---- strictness ------------------------------------------------------------------------------------


def test_minimal_llama():
    c = parse_hf_config(_cfg(bos_token_id=1, eos_token_id=[2, 3], tie_word_embeddings=True))
    assert c.family is Family.LLAMA
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (64, 4, 2, 16, 2)
    assert c.rope == RopeConfig()  # default RoPE, theta 10000
    assert c.sliding_windows == (None, None)
    assert c.tie_word_embeddings and not c.qkv_bias and not c.qk_norm
    assert c.bos_token_id == 1 and c.eos_token_ids == (2, 3)
    assert parse_hf_config(_cfg(eos_token_id=7)).eos_token_ids == (7,)


def test_unknown_keys_are_listed():
    with pytest.raises(ConfigError) as err:
        parse_hf_config(_cfg(shiny_new_feature=True, another_knob=3))
    assert "shiny_new_feature" in str(err.value) and "another_knob" in str(err.value)


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "whisper"])
def test_unsupported_model_type_is_named(model_type):
    with pytest.raises(ConfigError) as err:
        parse_hf_config(_cfg(model_type=model_type))
    assert model_type in str(err.value)


def test_missing_model_type():
    with pytest.raises(ConfigError, match="model_type"):
        parse_hf_config(_cfg(model_type=None))


@pytest.mark.parametrize(
    "key, value", [("hidden_act", "gelu"), ("hidden_act", "gelu_pytorch_tanh"), ("mlp_bias", True)]
)
def test_unsupported_values_are_named(key, value):
    with pytest.raises(ConfigError) as err:
        parse_hf_config(_cfg(**{key: value}))
    assert key in str(err.value) and str(value) in str(err.value)


@pytest.mark.parametrize("key", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size"])
def test_missing_required_key_is_named(key):
    with pytest.raises(ConfigError, match=key):
        parse_hf_config(_cfg(**{key: None}))


def test_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ConfigError, match="num_key_value_heads=3"):
        parse_hf_config(_cfg(num_key_value_heads=3))


def test_partial_rotary_is_refused():
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        parse_hf_config(_cfg(partial_rotary_factor=0.5))


@pytest.mark.parametrize("rope_type", ["longrope", "su", "mrope"])
def test_unsupported_rope_type_is_named(rope_type):
    with pytest.raises(ConfigError) as err:
        parse_hf_config(_cfg(rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4}))
    assert rope_type in str(err.value)


def test_unknown_rope_parameter_is_named():
    with pytest.raises(ConfigError, match="warp_speed"):
        parse_hf_config(_cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "warp_speed": 9}))


def test_scaled_rope_needs_a_factor():
    with pytest.raises(ConfigError, match="factor"):
        parse_hf_config(_cfg(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}))


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_config(tmp_path / "missing")


def test_load_from_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    assert load_hf_config(tmp_path) == load_hf_config(tmp_path / "config.json") == parse_hf_config(_cfg())


def test_load_with_overrides(tmp_path):
    """Overrides replace keys before the strict parse (a slice of a model keeps its widths)."""
    (tmp_path / "config.json").write_text(json.dumps(_cfg()))
    sliced = load_hf_config(tmp_path, {"num_hidden_layers": 1})
    assert sliced == parse_hf_config({**_cfg(), "num_hidden_layers": 1})
    assert sliced.num_layers == 1 and sliced.hidden_size == parse_hf_config(_cfg()).hidden_size
    with pytest.raises(ConfigError, match="not_a_key"):
        load_hf_config(tmp_path, {"not_a_key": 1})


# ---- what each family means -------------------------------------------------------------------------


def test_family_features():
    assert parse_hf_config(_cfg(model_type="qwen2")).qkv_bias
    q3 = parse_hf_config(_cfg(model_type="qwen3", head_dim=32))
    assert q3.qk_norm and q3.head_dim == 32 and not q3.qkv_bias
    bias = parse_hf_config(_cfg(attention_bias=True))
    assert bias.qkv_bias and bias.o_bias


def test_sliding_windows():
    assert parse_hf_config(_cfg(model_type="mistral", sliding_window=64)).sliding_windows == (64, 64)
    assert parse_hf_config(_cfg(model_type="mistral", sliding_window=None)).sliding_windows == (None, None)
    # Qwen2 only slides when use_sliding_window, and only from max_window_layers on.
    assert parse_hf_config(_cfg(model_type="qwen2", sliding_window=64)).sliding_windows == (None, None)
    qwen = _cfg(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert parse_hf_config(qwen).sliding_windows == (None, 64)
    explicit = _cfg(model_type="qwen3", sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    assert parse_hf_config(explicit).sliding_windows == (32, None)
    with pytest.raises(ConfigError, match="chunked_attention"):
        parse_hf_config(_cfg(model_type="qwen3", sliding_window=32, layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(ConfigError, match="sliding_window"):
        parse_hf_config(_cfg(model_type="qwen3", layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ConfigError, match="layer types"):
        parse_hf_config(_cfg(model_type="qwen3", sliding_window=32, layer_types=["full_attention"]))


@pytest.mark.parametrize(
    "config_cls, family",
    [
        (transformers.LlamaConfig, Family.LLAMA),
        (transformers.MistralConfig, Family.MISTRAL),
        (transformers.Qwen2Config, Family.QWEN2),
        (transformers.Qwen3Config, Family.QWEN3),
    ],
)
def test_configs_saved_by_transformers_parse(config_cls, family, tmp_path):
    """Every key transformers writes for these families, at its defaults, is handled."""
    hf = config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256)
    hf.save_pretrained(tmp_path)
    c = load_hf_config(tmp_path)
    assert c.family is family
    assert c.num_kv_heads == 2 and c.vocab_size == 256
    assert c.rope.theta == hf.rope_parameters["rope_theta"]
    assert c.rms_norm_eps == hf.rms_norm_eps and c.max_position_embeddings == hf.max_position_embeddings


# ---- legacy RoPE form ----------------------------------------------------------------------------

ROPE_PARAMS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
             "beta_slow": 2.0},
}


@pytest.mark.parametrize("name", list(ROPE_PARAMS))
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_legacy_rope_scaling_parses_like_rope_parameters(name, type_key):
    params = dict(ROPE_PARAMS[name])
    modern = parse_hf_config(_cfg(rope_parameters={**params, "rope_theta": 500000.0}))
    legacy_params = dict(params)
    legacy_params[type_key] = legacy_params.pop("rope_type")
    legacy = parse_hf_config(_cfg(rope_scaling=legacy_params, rope_theta=500000.0))
    assert legacy == modern
    assert modern.rope.type is RopeType(name) and modern.rope.theta == 500000.0


def test_top_level_original_max_position_embeddings():
    """The older llama3/yarn configs carried original_max_position_embeddings at the top level."""
    c = parse_hf_config(_cfg(rope_scaling={"type": "yarn", "factor": 4.0}, original_max_position_embeddings=256))
    assert c.rope.original_max_position == 256


# ---- round trip --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        _cfg(eos_token_id=[2, 5], bos_token_id=1),
        _cfg(model_type="mistral", sliding_window=64, tie_word_embeddings=True),
        _cfg(model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=1, eos_token_id=3),
        _cfg(model_type="qwen3", head_dim=32, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
             "original_max_position_embeddings": 256, "attention_factor": 1.25}),
        _cfg(rope_parameters={**ROPE_PARAMS["llama3"], "rope_theta": 5e5}),
    ],
    ids=["llama", "mistral", "qwen2_mixed", "qwen3_yarn", "llama3"],
)
def test_to_json_from_json_round_trip(raw):
    c = parse_hf_config(raw)
    text = json.dumps(c.to_json())
    back = ModelConfig.from_json(json.loads(text))
    assert back == c
    assert hash(back) == hash(c)  # the config is a static jit argument: it must hash by value


# ---- RoPE frequencies against transformers --------------------------------------------------------

HF_ROPE_CASES = {
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
                                    "rope_theta": 500000.0}),
    "llama3_wide": dict(head_dim=64, rope_parameters={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0,
                                                      "high_freq_factor": 8.0, "original_max_position_embeddings": 512,
                                                      "rope_theta": 500000.0}),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                  "rope_theta": 10000.0}),
    "yarn_head64": dict(head_dim=64, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                         "rope_theta": 1e6, "beta_fast": 8.0, "beta_slow": 0.5}),
    "yarn_mscale": dict(head_dim=64, max_position_embeddings=4096,
                        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                                         "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 0.707}),
    "yarn_attention_factor_no_truncate": dict(
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "rope_theta": 10000.0, "attention_factor": 1.3, "truncate": False}),
    "dynamic": dict(max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0}),
    "default_theta": dict(rope_parameters={"rope_type": "default", "rope_theta": 123456.0}),
}


def _hf_config(case: str) -> transformers.LlamaConfig:
    kwargs = {**{k: v for k, v in BASE.items() if k != "model_type"}, **HF_ROPE_CASES[case]}
    return transformers.LlamaConfig(**kwargs)


def _inv_freq_from_cos_sin(cos, sin) -> tuple[np.ndarray, np.ndarray]:
    """From the tables at position 1: (inverse frequencies [H/2], magnitude [H/2])."""
    cos, sin = np.asarray(cos, np.float64)[0, 0], np.asarray(sin, np.float64)[0, 0]
    half = cos.shape[-1] // 2
    assert np.allclose(cos[:half], cos[half:]) and np.allclose(sin[:half], sin[half:])
    return np.arctan2(sin[:half], cos[:half]), np.hypot(sin[:half], cos[:half])


@pytest.mark.parametrize("case", [c for c in HF_ROPE_CASES if c != "dynamic"])
def test_static_inv_freq_matches_transformers(case):
    hf = _hf_config(case)
    ours = parse_hf_config(hf.to_diff_dict())
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        head_dim = ours.head_dim
        ref = 1.0 / (hf.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ref_factor = 1.0
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    ref = ref.double().numpy()
    inv = static_inv_freq(ours.rope, ours.head_dim)
    assert inv.dtype == np.float32 and inv.shape == (ours.head_dim // 2,)
    np.testing.assert_allclose(inv, ref, rtol=2e-6)
    if rope_type == "yarn":
        assert yarn_attention_factor(ours.rope) == pytest.approx(ref_factor, rel=1e-6)
        assert ref_factor != 1.0
    # The same numbers come out of the cos/sin tables the model uses (and the yarn magnitude).
    cos, sin = rope_cos_sin(ours.rope, ours.head_dim, ours.max_position_embeddings, jnp.ones((1, 1), jnp.int32))
    freq, magnitude = _inv_freq_from_cos_sin(cos, sin)
    np.testing.assert_allclose(freq, ref, rtol=1e-5)
    np.testing.assert_allclose(magnitude, ref_factor, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [50, 128, 129, 300, 1000])
def test_dynamic_ntk_frequencies_match_transformers(seq_len):
    """Dynamic NTK: frequencies for the longest length seen; unscaled up to the context."""
    hf = _hf_config("dynamic")
    ours = parse_hf_config(hf.to_diff_dict())
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf, None, seq_len=seq_len)
    cos, sin = rope_cos_sin(ours.rope, ours.head_dim, ours.max_position_embeddings, jnp.ones((1, 1), jnp.int32),
                           jnp.int32(seq_len))
    freq, magnitude = _inv_freq_from_cos_sin(cos, sin)
    np.testing.assert_allclose(freq, ref.double().numpy(), rtol=1e-5)
    np.testing.assert_allclose(magnitude, 1.0, rtol=1e-6)
    base = static_inv_freq(ours.rope, ours.head_dim)
    if seq_len <= 128:
        np.testing.assert_allclose(freq, base, rtol=1e-5)
    else:
        assert freq[-1] < base[-1] * (1 - 1e-3)


@pytest.mark.parametrize("case", list(HF_ROPE_CASES))
def test_rope_tables_match_hf_rotary_embedding(case):
    """cos/sin for positions 0..599 against HF's LlamaRotaryEmbedding (dynamic: grown to 600)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config(case)
    ours = parse_hf_config(hf.to_diff_dict())
    positions = np.arange(600)[None]
    x = torch.zeros(1, 600, ours.head_dim)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(x, torch.from_numpy(positions))
    cos, sin = rope_cos_sin(ours.rope, ours.head_dim, ours.max_position_embeddings, jnp.asarray(positions, jnp.int32))
    # Angles reach ~600 rad, where one fp32 ulp is 6e-5: a one-ulp difference in an inverse
    # frequency (both sides round fp32 formulas) moves cos/sin by up to ~1e-4. A wrong frequency
    # (1e-5 relative, say) would move them by ~6e-3 at the far positions.
    np.testing.assert_allclose(np.asarray(cos), ref_cos.numpy(), atol=2e-4)
    np.testing.assert_allclose(np.asarray(sin), ref_sin.numpy(), atol=2e-4)
