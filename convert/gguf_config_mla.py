"""HF ``deepseek_v3`` config keys from the metadata of a llama.cpp ``deepseek2`` GGUF file.

llama.cpp writes DeepSeek-V3 (and Kimi-K2, the same architecture) as ``deepseek2``: latent
attention with the sizes below, leading dense layers, then MoE layers with routed and shared
experts. Two generations of files exist:

- older files: ``attention.key_length`` = qk_nope + qk_rope, ``attention.value_length`` =
  v_head_dim, ``attention.head_count_kv`` = the head count, and one ``attn_kv_b`` tensor;
- newer files (llama.cpp's MLA rewrite): ``key_length_mla`` / ``value_length_mla`` hold those two,
  ``key_length`` = kv_lora_rank + qk_rope and ``value_length`` = kv_lora_rank (the latent seen as
  one key/value head), ``head_count_kv`` = 1, and ``attn_kv_b`` split into ``attn_k_b`` /
  ``attn_v_b`` (see :mod:`dayzero.convert.name_map_gguf_mla`).

Routing: ``expert_gating_func`` 2 (sigmoid, DeepSeek-V3) with the selection bias ``exp_probs_b``;
llama.cpp reads a file without the key as softmax (DeepSeek-V2/V2.5), which dayzero has no family
for, so both are refused. Group-limited routing follows ``expert_group_count`` /
``expert_group_used_count``; files written before those keys existed route without groups in
llama.cpp, and so here. Top-k weights are renormalised iff ``expert_weights_norm``, scaled by
``expert_weights_scale``. Rotary pairs are adjacent (llama.cpp's "normal" RoPE for deepseek2,
HF's ``rope_interleave``), and its converter stores q and k rows unpermuted.
"""

from __future__ import annotations

from typing import Any, Callable

from dayzero.convert.errors import ConvertError

Get = Callable[[str], Any]

_SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID


def _latent(get: Get, require: Get, heads: int) -> dict[str, Any]:
    """The latent attention sizes of either generation (module docstring)."""
    rank, rope = int(require("attention.kv_lora_rank")), int(require("rope.dimension_count"))
    q_rank = get("attention.q_lora_rank")
    key, value = int(require("attention.key_length")), int(require("attention.value_length"))
    kv_heads = int(get("attention.head_count_kv") or heads)
    if get("attention.key_length_mla") is not None or get("attention.value_length_mla") is not None:
        if (key, value, kv_heads) != (rank + rope, rank, 1):
            raise ConvertError(
                f"GGUF deepseek2 attention.key_length={key}, value_length={value}, head_count_kv={kv_heads}: "
                f"a file with key_length_mla has kv_lora_rank + rope = {rank + rope}, kv_lora_rank = {rank} and 1"
            )
        key, value = int(require("attention.key_length_mla")), int(require("attention.value_length_mla"))
    elif kv_heads != heads:
        raise ConvertError(f"GGUF deepseek2 attention.head_count_kv={kv_heads} without key_length_mla: older files "
                           f"have one key/value head per query head ({heads})")
    if key <= rope:
        raise ConvertError(f"GGUF deepseek2 key length {key} must exceed rope.dimension_count={rope}")
    return {"q_lora_rank": None if q_rank is None else int(q_rank), "kv_lora_rank": rank,
            "qk_nope_head_dim": key - rope, "qk_rope_head_dim": rope, "v_head_dim": value,
            "num_key_value_heads": heads, "rope_interleave": True}


def _routing(get: Get, require: Get, layers: int) -> dict[str, Any]:
    """Experts and routing (module docstring)."""
    gating = get("expert_gating_func")
    if gating != _SIGMOID:
        raise ConvertError(
            f"GGUF deepseek2.expert_gating_func={gating} is not supported: only sigmoid routing ({_SIGMOID}, "
            "DeepSeek-V3 / Kimi-K2) is; softmax (1, or no key: DeepSeek-V2/V2.5) has no dayzero family"
        )
    dense = int(get("leading_dense_block_count") or 0)
    if not 0 <= dense <= layers:
        raise ConvertError(f"GGUF deepseek2.leading_dense_block_count={dense} is not between 0 and {layers}")
    return {
        "n_routed_experts": int(require("expert_count")), "num_experts_per_tok": int(require("expert_used_count")),
        "moe_intermediate_size": int(require("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count") or 0), "first_k_dense_replace": dense,
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm") or False),
        "n_group": int(get("expert_group_count") or 1), "topk_group": int(get("expert_group_used_count") or 1),
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }


def deepseek2_shape(get: Get, require: Get, heads: int, layers: int) -> dict[str, Any]:
    """The HF deepseek_v3 keys of attention, MLP widths and experts. ``get``/``require`` read
    ``deepseek2.<key>`` (and mark it translated)."""
    routing = _routing(get, require, layers)
    # The dense width matters only with leading dense layers (llama.cpp writes it always).
    ffn = require("feed_forward_length") if routing["first_k_dense_replace"] else get("feed_forward_length")
    return {"intermediate_size": int(ffn or routing["moe_intermediate_size"]), **_latent(get, require, heads),
            **routing}


def deepseek2_yarn(get: Get) -> dict[str, Any]:
    """YaRN's attention scale: llama.cpp stores 0.1 * HF's ``mscale_all_dim`` as
    ``rope.scaling.yarn_log_multiplier`` and computes as HF does when ``mscale`` equals it (the
    rotary cos/sin unscaled, the softmax scale times yarn_get_mscale(factor, mscale_all_dim)^2)."""
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if log_mul is None:
        return {}
    mscale = round(float(log_mul) * 10, 6)  # stored in float32: 0.1 reads back as 0.10000000149
    return {"mscale": mscale, "mscale_all_dim": mscale}
