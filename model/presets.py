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

PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _KIMI_K2,
    "frontier-3t-1m": _FRONTIER_3T_1M,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s config.json dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


def load_preset(name: str) -> ModelConfig:
    """Preset ``name`` parsed exactly as its config.json would be."""
    return parse_hf_config(preset_hf_config(name))
