"""Tiny HF models of the linear-attention hybrids and the weight trees they should convert to,
imported as ``tests.linear_helpers`` (tests/test_linear_config.py).

The expected leaves are written from the HF model's in-memory parameters (the names and layouts
its modeling code computes with, not the checkpoint spelling the converter reads), by expressions
independent of dayzero.convert: Qwen3-Next's fused projections through the HF layer's own
``fix_query_key_value_ordering``, the rest by plain slicing and reshaping of [out, in] weights.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

# Small, non-degenerate sizes: GQA (4 over 2), two value heads per key head (G = 2) with dk != dv,
# 3 conv taps, 4 experts of width 12 beside a shared width of 20, a dense width of 40.
QWEN_TEXT = dict(
    hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
QWEN_MOE = dict(moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
KIMI = dict(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
    intermediate_size=40, moe_intermediate_size=12, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
    kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, q_lora_rank=None,
    linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3, "kda_layers": [1, 3],
                        "full_attn_layers": [2]},
    first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
)


def qwen_next_config(**changes) -> transformers.Qwen3NextConfig:
    """Layer 0 dense (mlp_only_layers), the rest sparse."""
    return transformers.Qwen3NextConfig(**{**QWEN_TEXT, **QWEN_MOE, "intermediate_size": 40, "mlp_only_layers": [0],
                                           **changes})


def qwen35_moe_config(**changes) -> transformers.Qwen3_5MoeConfig:
    """The multimodal Qwen3.5-MoE (as published) with a one-block vision tower."""
    return transformers.Qwen3_5MoeConfig(text_config={**QWEN_TEXT, **QWEN_MOE, **changes}, vision_config=VISION)


def qwen35_multimodal_config(**changes) -> transformers.Qwen3_5Config:
    """The multimodal dense Qwen3.5 (as published), its embedding tied to lm_head as the small ones are."""
    return transformers.Qwen3_5Config(text_config={**QWEN_TEXT, "intermediate_size": 40, **changes},
                                      vision_config=VISION, tie_word_embeddings=True)


def qwen35_dense_config(**changes) -> transformers.Qwen3_5TextConfig:
    """The dense Qwen3.5 text model (what Qwen3_5ForCausalLM saves, model_type qwen3_5_text)."""
    return transformers.Qwen3_5TextConfig(**{**QWEN_TEXT, "intermediate_size": 40, **changes})


def kimi_config(**changes) -> transformers.KimiLinearConfig:
    """Layers KDA, MLA, KDA (1-based lists); layer 0 dense."""
    return transformers.KimiLinearConfig(**{**KIMI, **changes})


def random_model(config, seed: int = 0):
    """The HF causal LM of ``config`` (ForConditionalGeneration for a multimodal one) in fp32 with
    every parameter and buffer drawn at random: HF's constant inits (zero norms, unit dt_bias,
    zero selection bias) would hide a swapped tensor."""
    torch.manual_seed(seed)
    if isinstance(config, transformers.Qwen3_5MoeConfig):
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    elif isinstance(config, transformers.Qwen3_5Config):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_()
    return model


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def _text_state(model) -> tuple[dict[str, np.ndarray], str]:
    """The in-memory state dict as numpy, and the prefix of the text model's layers."""
    sd = {k: _np(v) for k, v in model.state_dict().items()}
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."
    return sd, prefix


def _dense(sd: dict, p: str, t: str) -> dict[str, np.ndarray]:
    return {t + "mlp/" + n: sd[p + f"mlp.{n}_proj.weight"].T for n in ("gate", "up", "down")}


def _fused_experts(sd: dict, p: str, t: str) -> dict[str, np.ndarray]:
    """HF's in-memory experts: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]."""
    gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
    F = gate_up.shape[1] // 2
    return {t + "mlp/gate": gate_up[:, :F].transpose(0, 2, 1), t + "mlp/up": gate_up[:, F:].transpose(0, 2, 1),
            t + "mlp/down": down.transpose(0, 2, 1), t + "mlp/router": sd[p + "mlp.gate.weight"].T}


def _conv(weight: np.ndarray, start: int, heads: int, dim: int) -> np.ndarray:
    """Taps of channels start.. as [W, heads, dim]: tap j of channel (h, d) is weight[start + h*dim + d, 0, j]."""
    W = weight.shape[2]
    return np.stack([weight[start:start + heads * dim, 0, j].reshape(heads, dim) for j in range(W)])


def _gated_delta(model, sd: dict, p: str, t: str, i: int, fused: bool) -> dict[str, np.ndarray]:
    lin = model.get_decoder().layers[i].linear_attn
    Hk, Hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
    a = p + "linear_attn."
    out = {t + "attn/A_log": sd[a + "A_log"], t + "attn/dt_bias": sd[a + "dt_bias"],
           t + "attn/norm": sd[a + "norm.weight"], t + "attn/o": sd[a + "out_proj.weight"].T.reshape(Hv, dv, -1)}
    conv = sd[a + "conv1d.weight"]
    out.update({t + "attn/conv_q": _conv(conv, 0, Hk, dk), t + "attn/conv_k": _conv(conv, Hk * dk, Hk, dk),
                t + "attn/conv_v": _conv(conv, 2 * Hk * dk, Hv, dv)})
    if fused:  # Qwen3-Next: HF's own reordering, applied to the weights' rows as if they were D tokens
        qkvz = torch.from_numpy(sd[a + "in_proj_qkvz.weight"].T[None])
        ba = torch.from_numpy(sd[a + "in_proj_ba.weight"].T[None])
        q, k, v, z, b, alpha = (_np(x[0]) for x in lin.fix_query_key_value_ordering(qkvz, ba))
        return {**out, t + "attn/q": q, t + "attn/k": k, t + "attn/v": v, t + "attn/gate": z, t + "attn/b": b,
                t + "attn/a": alpha}
    qkv, D = sd[a + "in_proj_qkv.weight"], sd[a + "in_proj_qkv.weight"].shape[1]
    return {**out, t + "attn/q": qkv[:Hk * dk].T.reshape(D, Hk, dk),
            t + "attn/k": qkv[Hk * dk:2 * Hk * dk].T.reshape(D, Hk, dk),
            t + "attn/v": qkv[2 * Hk * dk:].T.reshape(D, Hv, dv),
            t + "attn/gate": sd[a + "in_proj_z.weight"].T.reshape(D, Hv, dv),
            t + "attn/b": sd[a + "in_proj_b.weight"].T, t + "attn/a": sd[a + "in_proj_a.weight"].T}


def _gated_attention(sd: dict, p: str, t: str, N: int, K: int, H: int) -> dict[str, np.ndarray]:
    a = p + "self_attn."
    q = sd[a + "q_proj.weight"].T  # [D, N*2H]: HF views it as [.., N, 2H] and chunks into query | gate
    D = q.shape[0]
    return {t + "attn/q": q.reshape(D, N, 2 * H)[..., :H], t + "attn/gate": q.reshape(D, N, 2 * H)[..., H:],
            t + "attn/k": sd[a + "k_proj.weight"].T.reshape(D, K, H),
            t + "attn/v": sd[a + "v_proj.weight"].T.reshape(D, K, H),
            t + "attn/o": sd[a + "o_proj.weight"].T.reshape(N, H, D), t + "attn/q_norm": sd[a + "q_norm.weight"],
            t + "attn/k_norm": sd[a + "k_norm.weight"]}


def expected_qwen(model) -> dict[str, np.ndarray]:
    """The dayzero leaves of a Qwen3-Next / Qwen3.5 HF model (norms raw: the model adds 1)."""
    sd, p = _text_state(model)
    c = model.config.get_text_config()
    fused_qkvz = isinstance(c, transformers.Qwen3NextConfig)
    out = {"embed": sd[p + "embed_tokens.weight"], "final_norm": sd[p + "norm.weight"]}
    if not model.config.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    for i, kind in enumerate(c.layer_types):
        src, t = f"{p}layers.{i}.", f"layers/{i}/"
        out[t + "attn_norm"] = sd[src + "input_layernorm.weight"]
        out[t + "mlp_norm"] = sd[src + "post_attention_layernorm.weight"]
        if kind == "linear_attention":
            out.update(_gated_delta(model, sd, src, t, i, fused_qkvz))
        else:
            out.update(_gated_attention(sd, src, t, c.num_attention_heads, c.num_key_value_heads, c.head_dim))
        if src + "mlp.gate.weight" not in sd:
            out.update(_dense(sd, src, t))
            continue
        out.update(_fused_experts(sd, src, t))
        out[t + "mlp/shared_gate"] = sd[src + "mlp.shared_expert_gate.weight"][0]
        for n in ("gate", "up", "down"):
            out[t + f"mlp/shared/{n}"] = sd[src + f"mlp.shared_expert.{n}_proj.weight"].T
    return out


def _kda(model, sd: dict, p: str, t: str, i: int) -> dict[str, np.ndarray]:
    attn = model.model.layers[i].self_attn
    H, d = attn.num_heads, attn.head_dim
    a, fg = p + "self_attn.", p + "self_attn.forget_gate."
    D = sd[a + "q_proj.weight"].shape[1]
    conv = sd[a + "conv1d.weight"]
    out = {t + f"attn/{n}": sd[a + f"{n}_proj.weight"].T.reshape(D, H, d) for n in ("q", "k", "v")}
    out.update({
        t + "attn/conv_q": _conv(conv, 0, H, d), t + "attn/conv_k": _conv(conv, H * d, H, d),
        t + "attn/conv_v": _conv(conv, 2 * H * d, H, d), t + "attn/b": sd[a + "b_proj.weight"].T,
        t + "attn/decay_a": sd[fg + "f_a_proj.weight"].T,
        t + "attn/decay_b": sd[fg + "f_b_proj.weight"].T.reshape(d, H, d),
        t + "attn/dt_bias": sd[fg + "dt_bias"].reshape(H, d), t + "attn/A_log": sd[fg + "A_log"][0, 0, :, 0],
        t + "attn/gate_a": sd[a + "g_a_proj.weight"].T, t + "attn/gate_b": sd[a + "g_b_proj.weight"].T.reshape(d, H, d),
        t + "attn/norm": sd[a + "o_norm.weight"], t + "attn/o": sd[a + "o_proj.weight"].T.reshape(H, d, D),
    })
    return out


def _mla(sd: dict, p: str, t: str, c) -> dict[str, np.ndarray]:
    """DeepSeek-V3's latent attention layout (kv_b_proj per head [nope key | value] rows)."""
    a, N, P, V = p + "self_attn.", c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    kv_b = sd[a + "kv_b_proj.weight"].reshape(N, P + V, -1)
    D = sd[a + "kv_a_proj_with_mqa.weight"].shape[1]
    out = {t + "attn/kv_a": sd[a + "kv_a_proj_with_mqa.weight"].T,
           t + "attn/kv_a_norm": sd[a + "kv_a_layernorm.weight"],
           t + "attn/k_up": kv_b[:, :P].transpose(2, 0, 1), t + "attn/v_up": kv_b[:, P:].transpose(2, 0, 1),
           t + "attn/o": sd[a + "o_proj.weight"].T.reshape(N, V, D)}
    if c.q_lora_rank is None:
        out[t + "attn/q"] = sd[a + "q_proj.weight"].T.reshape(D, N, -1)
    else:
        out.update({t + "attn/q_a": sd[a + "q_a_proj.weight"].T, t + "attn/q_a_norm": sd[a + "q_a_layernorm.weight"],
                    t + "attn/q_b": sd[a + "q_b_proj.weight"].T.reshape(c.q_lora_rank, N, -1)})
    return out


def expected_kimi(model) -> dict[str, np.ndarray]:
    """The dayzero leaves of a Kimi-Linear HF model."""
    sd, c = {k: _np(v) for k, v in model.state_dict().items()}, model.config
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        out["lm_head"] = sd["lm_head.weight"].T
    for i, kind in enumerate(c.layer_types):
        src, t = f"model.layers.{i}.", f"layers/{i}/"
        out[t + "attn_norm"] = sd[src + "input_layernorm.weight"]
        out[t + "mlp_norm"] = sd[src + "post_attention_layernorm.weight"]
        out.update(_kda(model, sd, src, t, i) if kind == "linear_attention" else _mla(sd, src, t, c))
        if c.mlp_layer_types[i] == "dense":
            out.update(_dense(sd, src, t))
            continue
        out.update(_fused_experts(sd, src, t))
        out[t + "mlp/score_bias"] = sd[src + "mlp.gate.e_score_correction_bias"]
        for n in ("gate", "up", "down"):
            out[t + f"mlp/shared/{n}"] = sd[src + f"mlp.shared_experts.{n}_proj.weight"].T
    return out


def edit_checkpoint(hf_dir, tensors_edit=None, config_edit=None) -> None:
    """Edit a single-file HF checkpoint in place: ``tensors_edit(state dict)`` and/or
    ``config_edit(raw config dict)``."""
    import json

    from safetensors.torch import load_file, save_file

    if tensors_edit:
        tensors = load_file(hf_dir / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    if config_edit:
        raw = json.loads((hf_dir / "config.json").read_text())
        config_edit(raw)
        (hf_dir / "config.json").write_text(json.dumps(raw))
