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
- ``qwen3-next-80b-a3b``: Qwen3-Next-80B-A3B-Instruct (Gated DeltaNet hybrid, 512 experts, 10 per
  token, a gated shared expert); ``qwen3.5-397b-a17b``: Qwen3.5-397B-A17B, the largest Qwen3.5 MoE,
  in its published multimodal form (the text model under ``text_config``, the vision tower under
  ``vision_config``: both counted); ``kimi-linear-48b-a3b``: Kimi-Linear-48B-A3B-Instruct (Kimi Delta Attention
  and latent attention without RoPE, 1-based layer lists in ``linear_attn_config``). Sources are
  noted beside each.
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

# Qwen/Qwen3-Next-80B-A3B-Instruct. The hub file was not reachable from here: keys and values as
# the opening of its config.json is quoted in the code corpus (architectures through
# moe_intermediate_size, alphabetical: no attention_bias key) and HF Qwen3NextConfig's docstring
# checkpoint; the rest (experts, RoPE at theta 1e7 over a quarter of each head, 262144 positions)
# as several independent ports state them. 79.7B parameters (the MTP module, mtp.*, not counted).
_QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 151936,
}

# Qwen/Qwen3.5-397B-A17B. The hub file itself was not found by the search tools. Keys: those of the
# Qwen3.5-35B-A3B config.json (same architecture and release), transcribed in full in two
# third-party repositories. Sizes of the 397B: hidden 4096, 60 layers (3 Gated DeltaNet : 1 full),
# 32 query / 2 kv heads of 256, 16 key / 64 value linear heads of 128, 512 experts (10 per token)
# of width 1024 and a shared expert of 1024, vocabulary 248320, 262144 positions, as the
# mlx-community card and three independent ports (omegalax's registry among them) agree. The text
# model counts 396.3B parameters; with the 0.46B vision tower (depth 27, hidden 1152, out 4096), as
# Qwen3_5MoeVisionConfig's defaults and the 35B-A3B file give it, 396.8B: the published "397B".
_QWEN3_5_397B_A17B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": 248044,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 15,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 64,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 1024,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 60,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
            "rope_theta": 10000000, "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 1024,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_moe_vision",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

# moonshotai/Kimi-Linear-48B-A3B-Instruct: the structural keys as a third-party analyser pins
# them verbatim from the published config.json (with a leftover head_dim 72, which HF's modeling
# code never reads), the token ids as HF KimiLinearConfig's defaults (its docstring
# checkpoint). Layers 4, 8, ..., 24 and 27 (1-based) are latent attention, the rest KDA; layer 1
# is dense. 49.1B parameters (HF's count; published as "48B").
_KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_kimi.KimiLinearConfig",
        "AutoModel": "modeling_kimi.KimiLinearModel",
        "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
    },
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "pad_token_id": 163839,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
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
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B_A3B,
    "qwen3.5-397b-a17b": _QWEN3_5_397B_A17B,
    "kimi-linear-48b-a3b": _KIMI_LINEAR_48B_A3B,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s config.json dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


def load_preset(name: str) -> ModelConfig:
    """Preset ``name`` parsed exactly as its config.json would be."""
    return parse_hf_config(preset_hf_config(name))
