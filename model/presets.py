"""Named model configurations, written as the HF ``config.json`` their checkpoints publish.

They go through ``dayzero.model.hf_config.parse_hf_config`` exactly as a downloaded config.json
would, so a preset is only ever a shortcut for a file (``dayzero plan --preset NAME``).

- ``deepseek-v3``: DeepSeek-V3 (671B) as published by deepseek-ai (its config.json, keys and
  values; the multi-token-prediction layer is declared but not part of the decode weights).
- ``kimi-k2``: Kimi-K2-Instruct-0905 (1.03T) as published by moonshotai (the DeepSeek-V3
  architecture with 384 experts, 64 heads, one dense layer, a 163840-token vocabulary).
- ``frontier-3t-1m``: a 3.03-trillion-parameter DeepSeek-V3.2-style model designed here for a
  1M-token context: hidden 8192, 96 layers (3 dense), 512 routed experts of width 2560 (8 per
  token, plus one shared), MLA with 128 heads, and DeepSeek Sparse Attention (index_topk 2048),
  so a decode step reads 2048 latent rows per layer whatever the context. YaRN x256 over a
  4096-token original window gives 1,048,576 positions.
- ``gpt-oss-120b`` / ``gpt-oss-20b``: OpenAI's gpt-oss as published (their config.json, keys and
  values: 36 / 24 layers alternating a 128-token sliding window with full attention, 128 / 32
  experts of width 2880, 4 per token, attention sinks, YaRN x32 over 4096 positions). Their
  ``quantization_config`` (MXFP4 experts) says how the published files store the experts; the
  planner's own storage options (``--quantize``) say how dayzero would hold them.
- ``deepseek-v4-flash`` / ``deepseek-v4-pro``: DeepSeek-V4 (284B / 1.6T, 1M context) as
  published by deepseek-ai (their config.json, keys and values, in the legacy spelling HF's
  ``DeepseekV4Config`` folds in: ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``,
  the flat ``rope_scaling``). The planner sizes their cache as the serving engine's slot rows
  (``dayzero.model.footprint_v4``).
"""

from __future__ import annotations

import copy
from typing import Any

from dayzero.model.config import ConfigError, ModelConfig
from dayzero.model.hf_config import parse_hf_config

_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

_KIMI_K2: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 262144,
    "model_type": "kimi_k2",
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "transformers_version": "4.48.3",
    "vocab_size": 163840,
}

_FRONTIER_3T_1M: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "intermediate_size": 24576,
    "kv_lora_rank": 512,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 2560,
    "n_group": 8,
    "n_routed_experts": 512,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 96,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 256, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}

_GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

_GPT_OSS_20B: dict[str, Any] = {
    **_GPT_OSS_120B,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
}

# GLM-5 (zai-org/GLM-5, 744B): HF GlmMoeDsaConfig's defaults are its published sizes; every
# layer runs its own indexer (no indexer_types), one MTP layer (not decoded, not counted).
_GLM_5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dtype": "bfloat16",
    "eos_token_id": [154820, 154827, 154829],
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "indexer_rope_interleave": True,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "model_type": "glm_moe_dsa",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 78,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 154820,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 256,
    "vocab_size": 154880,
}

# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash): its sizes are HF DeepseekV4Config's defaults;
# the values were copied from third-party copies of the published config.json (the hub itself was
# not reachable from here), which agree with HF's defaults and with NOTES.md's V4 study. Layers 0-1
# attend over the sliding window only, then CSA (ratio 4) on even and HCA (128) on odd layers; the
# last compress_ratios entry is the MTP layer's. FP8 weights; the experts are stored as FP4.
_DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536, "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

# DeepSeek-V4-Pro (deepseek-ai/DeepSeek-V4-Pro): Flash's keys with the Pro sizes. Secondary sources
# only (two third-party copies of its config.json, which agree with each other): hidden 7168, 61
# layers, 128 heads, q_lora_rank 1536, 16 output groups, 384 experts of width 3072, scaling 2.5,
# index_topk 1024 (one hub mirror says 512; NOTES.md's study), layers 0-1 HCA then CSA on even and
# HCA on odd layers. Check against the hub's config.json when it can be reached.
_DEEPSEEK_V4_PRO: dict[str, Any] = {
    **_DEEPSEEK_V4_FLASH,
    "hidden_size": 7168,
    "index_topk": 1024,
    "moe_intermediate_size": 3072,
    "n_routed_experts": 384,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "o_groups": 16,
    "q_lora_rank": 1536,
    "routed_scaling_factor": 2.5,
    "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _KIMI_K2,
    "frontier-3t-1m": _FRONTIER_3T_1M,
    "glm-5": _GLM_5,
    "gpt-oss-120b": _GPT_OSS_120B,
    "gpt-oss-20b": _GPT_OSS_20B,
    "deepseek-v4-flash": _DEEPSEEK_V4_FLASH,
    "deepseek-v4-pro": _DEEPSEEK_V4_PRO,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s config.json dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


def load_preset(name: str) -> ModelConfig:
    """Preset ``name`` parsed exactly as its config.json would be."""
    return parse_hf_config(preset_hf_config(name))
