"""The config.json files of real published checkpoints parse to the right family and sizes.

Parsing only (no models, no weights). Each config below is the file as its publisher put it on
the hub, keys and values, copied from a verbatim third-party copy noted next to it (GLM-4.5's is
the one written from the hub page without such a copy). The bookkeeping keys other
tools add when they save a checkpoint are accepted; an unknown key is still refused by name.
"""

from __future__ import annotations

import pytest

from dayzero.model.config import AttentionKind, ConfigError, Family, RopeType
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.presets import preset_hf_config

# Where a file below came from. Two copies are cited by repository and path. A third, a markdown
# file in the search tools' code corpus that dumps, for several hub checkpoints, the parameter
# shapes and then the config.json (index file id 61558565367; the tools do not name its
# repository), is called "the shapes dump" below.

# meta-llama/Llama-3.1-8B-Instruct, verbatim from the shapes dump. The base Llama-3.1-8B file
# (LLAMA_31_8B below) differs only in eos_token_id and transformers_version.
LLAMA_31_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 128256,
}

# meta-llama/Llama-3.1-8B (base): the Instruct file with the base's single end token and
# transformers_version, which makes it, key for key, the file vendored verbatim by
# github.com/ai-dynamo/aiconfigurator
# aic-core/src/aiconfigurator_core/model_configs/meta-llama--Meta-Llama-3.1-8B_config.json and by
# github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md.
LLAMA_31_8B = {**LLAMA_31_8B_INSTRUCT, "eos_token_id": 128001, "transformers_version": "4.43.0.dev0"}

# mistralai/Mistral-7B-Instruct-v0.3, verbatim from the shapes dump; a second copy (a Python dict
# in a vision-language project's model code, index file id 39283178372) has the same keys and
# values. v0.3 extends the vocabulary to 32768 and drops the sliding window.
MISTRAL_7B_INSTRUCT_V03 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768,
}

# Qwen/Qwen2.5-7B-Instruct, verbatim from the shapes dump. The base Qwen2.5-7B file vendored by
# citsjtu2020/LLM-Prof also carries use_mrope: false (tested below), eos 151643 and 131072 positions.
QWEN25_7B_INSTRUCT = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}

# Qwen/Qwen3-8B, verbatim from citsjtu2020/LLM-Prof (sglang/Model_Config.md); ai-dynamo/aiconfigurator
# aic-core/src/aiconfigurator_core/model_configs/Qwen--Qwen3-8B_config.json is the same file.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

# Qwen/Qwen3-30B-A3B, verbatim from citsjtu2020/LLM-Prof (sglang/Model_Config.md); aiconfigurator's
# aic-core/src/aiconfigurator_core/model_configs/Qwen--Qwen3-30B-A3B_config.json is the same file.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# mistralai/Mixtral-8x7B-v0.1, verbatim from github.com/ai-dynamo/aiconfigurator
# src/aiconfigurator/model_configs/mistralai--Mixtral-8x7B-v0.1_config.json (added as a
# "pre-downloaded config.json", commit 38028ec8). No verbatim copy of the Instruct file was found.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}

# deepseek-ai/DeepSeek-V3.2, verbatim from github.com/ai-dynamo/aiconfigurator
# src/aiconfigurator/model_configs/deepseek-ai--DeepSeek-V3.2_config.json (commit 86911fab):
# DeepSeek-V3's keys plus the indexer, and the "scale_fmt": "ue8m0" that DeepSeek's FP8
# checkpoints carry since V3.1. (It is the file this test held, written from the hub, for V3.2-Exp.)
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.44.2",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# moonshotai/Kimi-K2-Instruct (July 2025, 128k context, YaRN x32), verbatim from
# github.com/ai-dynamo/aiconfigurator
# src/aiconfigurator/model_configs/moonshotai--Kimi-K2-Instruct_config.json (commit d5bad971; an
# earlier commit there held a shortened copy). Unlike DeepSeek-V3's file it has
# no ep_size, and rope_scaling follows routed_scaling_factor, as in the derived Kimi-K2 copies
# elsewhere in the code corpus.
KIMI_K2_INSTRUCT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 131072, "model_type": "kimi_k2",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.48.3", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}

# HuggingFaceTB/SmolLM2-135M (base), verbatim from two copies in the code corpus whose repositories
# the tools do not name: a markdown study of the model (index file id 11598493191) and a Rust
# config test (id 70335804244, line breaks aside); a third (id 57806107398) writes 1e-5 for 1e-05.
# No verbatim copy of the Instruct file was found (a transformers printout of a model fine-tuned
# from it shows pad_token_id 2 and a transformers.js_config besides these keys).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
    "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False,
    "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "vocab_size": 49152,
}

# zai-org/GLM-4.5 (written from the hub file; no verbatim copy found in the code corpus;
# tests/test_glm4_moe.py has the same keys shrunk).
GLM_45 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True,
    "vocab_size": 151552,
}

# name -> (config, family, (vocab, hidden, layers, heads, kv heads, head_dim), experts or None)
PUBLISHED = {
    "Llama-3.1-8B-Instruct": (LLAMA_31_8B_INSTRUCT, Family.LLAMA, (128256, 4096, 32, 32, 8, 128), None),
    "Llama-3.1-8B": (LLAMA_31_8B, Family.LLAMA, (128256, 4096, 32, 32, 8, 128), None),
    "Mistral-7B-Instruct-v0.3": (MISTRAL_7B_INSTRUCT_V03, Family.MISTRAL, (32768, 4096, 32, 32, 8, 128), None),
    "Qwen2.5-7B-Instruct": (QWEN25_7B_INSTRUCT, Family.QWEN2, (152064, 3584, 28, 28, 4, 128), None),
    "Qwen3-8B": (QWEN3_8B, Family.QWEN3, (151936, 4096, 36, 32, 8, 128), None),
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, Family.QWEN3_MOE, (151936, 2048, 48, 32, 4, 128), (128, 8, 768)),
    "Mixtral-8x7B-v0.1": (MIXTRAL_8X7B, Family.MIXTRAL, (32000, 4096, 32, 32, 8, 128), (8, 2, 14336)),
    # MLA: head_dim is the rotary part (qk_rope_head_dim), kv heads = heads.
    "DeepSeek-V3": (preset_hf_config("deepseek-v3"), Family.DEEPSEEK_V3, (129280, 7168, 61, 128, 128, 64),
                    (256, 8, 2048)),
    "DeepSeek-V3.2": (DEEPSEEK_V32, Family.DEEPSEEK_V32, (129280, 7168, 61, 128, 128, 64), (256, 8, 2048)),
    "Kimi-K2-Instruct": (KIMI_K2_INSTRUCT, Family.KIMI_K2, (163840, 7168, 61, 64, 64, 64), (384, 8, 2048)),
    "SmolLM2-135M": (SMOLLM2_135M, Family.LLAMA, (49152, 576, 30, 9, 3, 64), None),
    "GLM-4.5": (GLM_45, Family.GLM4_MOE, (151552, 5120, 92, 96, 8, 128), (160, 8, 1536)),
    "gpt-oss-120b": (preset_hf_config("gpt-oss-120b"), Family.GPT_OSS, (201088, 2880, 36, 64, 8, 64),
                     (128, 4, 2880)),
}

# DeepSeek's FP8 quantization_config carries "scale_fmt": "ue8m0" since V3.1 (how its own FP8
# kernels round activation scales; the stored weight_scale_inv are what dequantization uses).


def _cases():
    for name, case in PUBLISHED.items():
        yield pytest.param(name, *case, id=name)


def _sizes(c) -> tuple:
    return (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim)


@pytest.mark.parametrize("name, raw, family, sizes, experts", list(_cases()))
def test_published_config_parses(name, raw, family, sizes, experts):
    c = parse_hf_config(raw)
    assert c.family is family and _sizes(c) == sizes, name
    if experts is None:
        assert c.moe is None
    else:
        assert (c.moe.num_experts, c.moe.experts_per_token, c.moe.intermediate_size) == experts


def test_published_deepseek_v32_reaches_the_config():
    """DeepSeek-V3.2's indexer, layer kinds and MTP layer; its quantization_config's scale_fmt
    is accepted at ue8m0 only (another value would be a scheme dayzero has not read)."""
    c = parse_hf_config(DEEPSEEK_V32)
    assert c.family is Family.DEEPSEEK_V32 and c.attention is AttentionKind.MLA
    assert (c.dsa.topk, c.dsa.heads, c.dsa.head_dim) == (2048, 64, 128) and c.mtp_layers == 1
    assert c.moe.layers == (False,) * 3 + (True,) * 58 and c.moe.num_groups == 8
    other = {**DEEPSEEK_V32, "quantization_config": {**DEEPSEEK_V32["quantization_config"], "scale_fmt": "e4m3"}}
    with pytest.raises(ConfigError, match="quantization_config"):
        parse_hf_config(other)


def test_published_details():
    """What sets each published file apart reaches the ModelConfig."""
    llama = parse_hf_config(LLAMA_31_8B_INSTRUCT)
    assert llama.rope.type is RopeType.LLAMA3 and llama.rope.factor == 8.0 and llama.rope.original_max_position == 8192
    assert llama.eos_token_ids == (128001, 128008, 128009) and not llama.tie_word_embeddings
    assert parse_hf_config(LLAMA_31_8B).eos_token_ids == (128001,)
    mistral = parse_hf_config(MISTRAL_7B_INSTRUCT_V03)
    assert mistral.sliding_windows == (None,) * 32 and mistral.rope.theta == 1e6
    qwen2 = parse_hf_config(QWEN25_7B_INSTRUCT)
    assert qwen2.qkv_bias and qwen2.sliding_windows == (None,) * 28  # use_sliding_window: false
    qwen3 = parse_hf_config(QWEN3_8B)
    assert qwen3.qk_norm and not qwen3.qkv_bias
    qwen_moe = parse_hf_config(QWEN3_30B_A3B)
    assert qwen_moe.moe.renormalize and all(qwen_moe.moe.layers)
    mixtral = parse_hf_config(MIXTRAL_8X7B)
    assert mixtral.sliding_windows == (None,) * 32 and all(mixtral.moe.layers) and mixtral.moe.renormalize
    kimi = parse_hf_config(KIMI_K2_INSTRUCT)
    assert kimi.mla.q_lora_rank == 1536 and kimi.rope.factor == 32.0 and kimi.moe.layers[:2] == (False, True)
    assert kimi.max_position_embeddings == 131072 and kimi.mtp_layers == 0 and kimi.eos_token_ids == (163585,)
    smol = parse_hf_config(SMOLLM2_135M)
    assert smol.tie_word_embeddings and smol.rope.theta == 1e5 and smol.eos_token_ids == (0,)
    glm = parse_hf_config(GLM_45)
    assert glm.rope.partial_rotary_factor == 0.5 and glm.qk_norm and glm.mtp_layers == 1


def test_qwen25_base_use_mrope_false_is_accepted_and_true_refused():
    """The base Qwen2.5 files (LLM-Prof's copy of Qwen2.5-7B) carry use_mrope: false."""
    base = {**QWEN25_7B_INSTRUCT, "use_mrope": False, "eos_token_id": 151643, "max_position_embeddings": 131072,
            "transformers_version": "4.40.1"}
    assert parse_hf_config(base).family is Family.QWEN2
    with pytest.raises(ConfigError, match="use_mrope"):
        parse_hf_config({**base, "use_mrope": True})


def test_rope_interleaved_true_is_refused():
    """nanotron's rope_interleaved is accepted only at the value HF's Llama computes (false)."""
    with pytest.raises(ConfigError, match="rope_interleaved"):
        parse_hf_config({**SMOLLM2_135M, "rope_interleaved": True})


# Keys that transformers, the hub, GGUF loaders and older save_pretrained calls stamp on a file.
BOOKKEEPING = {
    "_model_name_or_path": "bartowski/Qwen2.5-7B-Instruct-GGUF",  # transformers' GGUF loader
    "_name_or_path": "/models/qwen", "_commit_hash": "a09a35458c702b33eeacc393d103063234e8bc28",
    "_attn_implementation": "sdpa", "unk_token_id": 0, "sep_token_id": None, "decoder_start_token_id": 0,
    "auto_map": {"AutoConfig": "configuration_x.XConfig"}, "transformers_version": "4.46.0",
    "architectures": ["Qwen2ForCausalLM"], "temperature": 0.7, "top_p": 0.8, "top_k": 20,
    "do_sample": True, "repetition_penalty": 1.05, "max_length": 20, "num_beams": 1,
    "tokenizer_class": "Qwen2Tokenizer", "add_cross_attention": False, "task_specific_params": None,
    # transformers.js's KV-cache dtypes, as SmolLM2-135M-Instruct's file carries them.
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
}


@pytest.mark.parametrize("key", sorted(BOOKKEEPING))
def test_bookkeeping_key_is_accepted(key):
    expected = parse_hf_config(QWEN25_7B_INSTRUCT)
    assert parse_hf_config({**QWEN25_7B_INSTRUCT, key: BOOKKEEPING[key]}) == expected


def test_all_bookkeeping_keys_together_are_accepted():
    assert parse_hf_config({**QWEN25_7B_INSTRUCT, **BOOKKEEPING}) == parse_hf_config(QWEN25_7B_INSTRUCT)


@pytest.mark.parametrize("key, value", [
    ("attn_logit_softcapping", 50.0),  # Gemma-2's tanh cap on attention scores: changes them
    ("final_logit_softcapping", 30.0),
    ("token_id_offset", 3),  # looks like the token-id rule, but only its suffix counts
    ("add_cross_attention", True),
])
def test_unknown_or_unsupported_key_is_refused_by_name(key, value):
    with pytest.raises(ConfigError) as err:
        parse_hf_config({**LLAMA_31_8B_INSTRUCT, key: value})
    message = str(err.value)
    assert key in message and "\n" not in message
