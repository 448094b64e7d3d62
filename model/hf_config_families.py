"""Per-family parts of :func:`dayzero.model.hf_config.parse_hf_config`: DeepSeek-V3 / Kimi-K2
routing, MiniMax-M2 and gpt-oss checks and experts, latent attention (MLA) and the DSA indexer
(DeepSeek-V3.2, GLM-5).

Same contract as hf_config: every key is read, ignored for a stated reason, or checked against
the one value HF's implementation computes. hf_config imports this module at load time (and
re-exports what other modules import from it), so names kept there are imported lazily here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dayzero.model.config import ConfigError, DSAConfig, Family, MLAConfig, MoEConfig, RopeConfig, RouterScore

if TYPE_CHECKING:
    from dayzero.model.hf_config import _Reader


# DeepSeek-V3 / Kimi-K2 keys that only matter for training or for a parallel layout.
_DEEPSEEK_TRAINING_ONLY = {
    "aux_loss_alpha": "weight of the auxiliary balance loss",
    "seq_aux": "computes that loss per sequence",
    "ep_size": "expert-parallel world size of the reference code; the math is the same on any layout",
}


def _deepseek_moe_layers(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """Layers ``first_k_dense_replace`` and up are sparse. DeepSeek's own code also requires
    ``i % moe_layer_freq == 0`` while HF's ignores it: only 1, where both agree, is accepted.
    HF deepseek_v32 writes the per-layer list ``mlp_layer_types`` ("dense"/"sparse"), which wins."""
    from dayzero.model.hf_config import _TRAITS  # lazily: hf_config imports this module

    first_dense = r.get("first_k_dense_replace", 0)
    kinds = r.get("mlp_layer_types") if _TRAITS[Family(r.raw["model_type"])].dsa else None
    if kinds is not None:
        if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
            raise ConfigError(f"mlp_layer_types={kinds!r} must give 'dense' or 'sparse' for each of {num_layers} layers")
        return tuple(k == "sparse" for k in kinds)
    if not isinstance(first_dense, int) or not 0 <= first_dense <= num_layers:
        raise ConfigError(f"first_k_dense_replace={first_dense!r} must be between 0 and num_hidden_layers={num_layers}")
    if r.get("moe_layer_freq", 1) != 1:
        raise ConfigError(
            f"moe_layer_freq={r.raw['moe_layer_freq']!r} is not supported (DeepSeek's reference code and HF "
            "disagree on it); only 1 is"
        )
    return tuple(i >= first_dense for i in range(num_layers))


def _deepseek_moe(r: _Reader, num_layers: int) -> MoEConfig:
    """DeepSeek-V3 routing: sigmoid scores, a selection bias (noaux_tc), group-limited top-k."""
    r.seen.update(_DEEPSEEK_TRAINING_ONLY)
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if r.get(key, allowed) != allowed:
            raise ConfigError(f"{key}={r.raw[key]!r} is not supported for {r.raw['model_type']}; only {allowed!r} is")
    return MoEConfig(
        int(r.require("n_routed_experts")), int(r.require("num_experts_per_tok")),
        int(r.require("moe_intermediate_size")), _deepseek_moe_layers(r, num_layers),
        score=RouterScore.SIGMOID, renormalize=bool(r.get("norm_topk_prob", False)), score_bias=True,
        num_groups=int(r.get("n_group", 1)), groups_per_token=int(r.get("topk_group", 1)),
        routed_scaling=float(r.get("routed_scaling_factor", 1.0)), shared_experts=int(r.get("n_shared_experts", 0)),
    )


# MiniMax-M2 keys that HF's minimax_m2 does not read: each is accepted only at the value that
# describes what that implementation computes, so a checkpoint meaning otherwise is refused.
_MINIMAX_FIXED = {
    "use_qk_norm": True,  # HF always norms q and k
    "qk_norm_type": "per_layer",  # one RMS over all heads of a token ("per_head" would be Qwen3's)
    "scoring_func": "sigmoid",
    "use_routing_bias": True,  # e_score_correction_bias in every layer
    "shared_intermediate_size": 0,  # no shared expert
    "attention_bias": False,
    "use_sliding_window": False,
}


def _minimax_checks(r: _Reader, num_layers: int) -> None:
    """Refuse what HF's minimax_m2 would silently compute differently from what the file says:
    fixed keys off their value, a sliding window, or a layer that is not full softmax attention."""
    for key, allowed in _MINIMAX_FIXED.items():
        if r.get(key, allowed) != allowed:
            raise ConfigError(
                f"{key}={r.raw[key]!r} is not supported for minimax_m2, whose HF implementation computes "
                f"{key}={allowed!r}; fix the config or use the model_type it was written for"
            )
    r.seen.add("shared_moe_mode")  # how a shared expert would be gated: there is none
    r.seen.add("auto_map")  # code pointers of the hub's remote implementation, never run
    if r.get("sliding_window") is not None:
        raise ConfigError(f"sliding_window={r.raw['sliding_window']!r} is not supported for minimax_m2 "
                          "(HF's minimax_m2 attends over all tokens in every layer); set it to null")
    types = r.get("attn_type_list")
    if types is not None and (len(types) != num_layers or any(t != 1 for t in types)):
        raise ConfigError(
            f"attn_type_list={types!r} must be 1 (full softmax attention) for each of {num_layers} layers; "
            "MiniMax-01's lightning (linear) attention layers (0) are not supported"
        )
    layer_types = r.get("layer_types")
    if layer_types is not None and (len(layer_types) != num_layers or set(layer_types) != {"full_attention"}):
        raise ConfigError(f"layer_types={layer_types!r} must be 'full_attention' for each of {num_layers} layers "
                          "for minimax_m2")


def _minimax_moe(r: _Reader, num_layers: int) -> MoEConfig:
    """MiniMax-M2 routing (HF MiniMaxM2TopKRouter): sigmoid scores, the top-k of scores plus
    ``e_score_correction_bias`` chosen, their unbiased scores renormalised to sum 1; no groups,
    no scaling, no shared expert; every layer sparse, experts ``intermediate_size`` wide."""
    from dayzero.model.hf_config import _num_experts  # lazily: hf_config imports this module

    return MoEConfig(
        _num_experts(r), int(r.require("num_experts_per_tok")), int(r.require("intermediate_size")),
        (True,) * num_layers, score=RouterScore.SIGMOID, renormalize=True, score_bias=True,
    )


def _minimax_mtp_layers(r: _Reader) -> int:
    """MiniMax-M2's multi-token-prediction modules (``use_mtp``, ``num_mtp_modules`` of
    ``mtp_transformer_layers`` layers each): counted so the converter skips and lists their
    tensors, stored like DeepSeek's after the last layer; plain decoding never runs them."""
    modules, depth = int(r.get("num_mtp_modules", 0)), int(r.get("mtp_transformer_layers", 1))
    return modules * depth if r.get("use_mtp", False) else 0


# HF GptOssConfig's RoPE when a config.json has neither rope_parameters nor rope_scaling.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """HF GptOssConfig's defaults that depend on other keys: sliding_attention at even layers,
    full at odd ones; YaRN x32 over 4096 positions (theta 150000) unless either RoPE key is set."""
    filled: dict[str, Any] = {}
    if raw.get("layer_types") is None and raw.get("num_hidden_layers") is not None:
        filled["layer_types"] = ["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(int(raw["num_hidden_layers"]))]
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        filled["rope_parameters"] = dict(_GPT_OSS_ROPE)
    if raw.get("rope_theta") is None and (raw.get("rope_parameters") or {}).get("rope_theta") is None:
        filled["rope_theta"] = 150000.0
    return filled


def _gpt_oss_checks(r: _Reader, moe: MoEConfig, rope: RopeConfig) -> None:
    """Keys of the published gpt-oss config.json that HF's gpt_oss does not read (OpenAI's own
    names), accepted only where they agree with the ones it does."""
    same = {"experts_per_token": moe.experts_per_token,  # num_experts_per_tok
            "initial_context_length": rope.original_max_position}  # YaRN's original window
    for key, value in same.items():
        if r.get(key, value) != value:
            raise ConfigError(f"{key}={r.raw[key]!r} disagrees with the value HF's gpt_oss uses ({value}); "
                              "fix the config")


def _gpt_oss_moe(r: _Reader, num_layers: int) -> MoEConfig:
    """gpt-oss's experts (HF GptOssMLP): softmax over the top-k biased router logits (= softmax
    over all, renormalised over the chosen), every layer sparse, experts ``intermediate_size``
    wide with biases and the clamped SwiGLU (alpha, limit, up + 1)."""
    from dayzero.model.hf_config import _num_experts  # lazily: hf_config imports this module

    return MoEConfig(
        _num_experts(r), int(r.require("num_experts_per_tok")), int(r.require("intermediate_size")),
        (True,) * num_layers, renormalize=True, router_bias=True, expert_bias=True,
        swiglu_limit=float(r.require("swiglu_limit")), swiglu_alpha=float(r.require("swiglu_alpha")),
        swiglu_up_shift=1.0,
    )


def _parse_mla(r: _Reader, num_heads: int) -> MLAConfig:
    """Latent attention sizes; HF's derived ``head_dim`` / ``qk_head_dim`` must agree with them."""
    mla = MLAConfig(
        q_lora_rank=None if r.get("q_lora_rank") is None else int(r.raw["q_lora_rank"]),
        kv_lora_rank=int(r.require("kv_lora_rank")),
        nope_dim=int(r.require("qk_nope_head_dim")),
        rope_dim=int(r.require("qk_rope_head_dim")),
        v_head_dim=int(r.require("v_head_dim")),
        rope_interleave=bool(r.get("rope_interleave", True)),
    )
    derived = {"head_dim": mla.rope_dim, "qk_head_dim": mla.nope_dim + mla.rope_dim, "num_key_value_heads": num_heads}
    if r.raw.get("model_type") == Family.GLM_MOE_DSA.value:
        # HF's glm_moe_dsa sets head_dim to qk_rope_head_dim whatever the file says (the
        # published GLM-5 configs write another value there), so the key is read and not checked.
        del derived["head_dim"]
        r.seen.add("head_dim")
    for key, expected in derived.items():
        if r.get(key, expected) != expected:
            raise ConfigError(f"{key}={r.raw[key]!r} contradicts the latent attention sizes, which imply {expected}")
    if r.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported for latent attention")
    return mla


def _glm_indexer_types(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """GLM-5's per-layer indexer kinds as HF GlmMoeDsaConfig derives them, True for "shared":
    ``indexer_types``, else ``index_topk_pattern`` ("F"/"S" per layer), else layer i is full iff
    max(i - offset + 1, 0) % freq == 0 (``index_topk_freq``, ``index_skip_topk_offset``)."""
    kinds, pattern = r.get("indexer_types"), r.get("index_topk_pattern")
    freq, offset = r.get("index_topk_freq", 1), r.get("index_skip_topk_offset", 2)
    if kinds is None and pattern is not None:
        names = {"F": "full", "S": "shared"}
        # As HF: only a string is spelled in letters; a list must already say "full"/"shared".
        kinds = [names.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        if not isinstance(freq, int) or not isinstance(offset, int):
            raise ConfigError(f"index_topk_freq={freq!r} and index_skip_topk_offset={offset!r} must be integers")
        freq = max(freq, 1)  # as HF: a frequency below 1 means every layer
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise ConfigError(f"indexer_types={kinds!r} must give 'full' or 'shared' for each of {num_layers} layers, "
                          "the first 'full' (a shared layer reuses the picks of the full one before it)")
    return tuple(k == "shared" for k in kinds)


def _parse_dsa(r: _Reader, num_layers: int) -> DSAConfig:
    """The indexer of DeepSeek-V3.2 (defaults: HF DeepseekV32Config's) or GLM-5: interleaved
    RoPE pairs in the indexer and "shared" layers reusing the last full layer's picks."""
    glm = r.raw.get("model_type") == Family.GLM_MOE_DSA.value
    if glm:
        # HF's glm_moe_dsa always rotates interleaved pairs in the indexer; the published config
        # states it as indexer_rope_interleave. index_share_for_mtp_iteration concerns the MTP
        # layer's indexer, which plain decoding never runs.
        r.seen.add("index_share_for_mtp_iteration")
        if not r.get("indexer_rope_interleave", True):
            raise ConfigError("indexer_rope_interleave=false is not supported for glm_moe_dsa "
                              "(HF's indexer rotates interleaved pairs)")
    dsa = DSAConfig(topk=int(r.get("index_topk", 2048)), heads=int(r.get("index_n_heads", 64)),
                    head_dim=int(r.get("index_head_dim", 128)), rope_interleave=glm,
                    shared=_glm_indexer_types(r, num_layers) if glm else ())
    if min(dsa.topk, dsa.heads, dsa.head_dim) < 1:
        raise ConfigError(f"index_topk, index_n_heads and index_head_dim must be positive, got {dsa}")
    # HF's deepseek_v32 always rotates the main attention's interleaved pairs and has no such key.
    if not r.get("rope_interleave", True):
        raise ConfigError(f"rope_interleave=false is not supported for {r.raw['model_type']} "
                          "(its attention is interleaved)")
    return dsa
