"""Name maps of the linear-attention hybrids (``dayzero.convert.name_map.hf_name_map`` hands every
config with ``linear`` settings here): Qwen3-Next, Qwen3.5 (dense and MoE), Kimi-Linear.

Each map has one recipe set per spelling of the same tensors (:class:`NameMap` alternatives; the
one whose tensors the source has is used):

- Qwen3-Next: experts per expert (``mlp.experts.{e}.gate_proj.weight`` ..., as published and as
  transformers 5.24's ``save_pretrained`` writes them) or fused (``mlp.experts.gate_up_proj``
  [E, 2F, D] gate rows first, ``down_proj`` [E, D, F]; ``save_original_format=False``).
- Qwen3.5: under ``model.language_model.`` (the published multimodal checkpoints and
  ``Qwen3_5*ForConditionalGeneration.save_pretrained``) or ``model.`` (``Qwen3_5*ForCausalLM``);
  MoE experts fused (the published bf16 files) or per expert (the published FP8 files,
  ``save_pretrained``'s default). A multimodal file's vision tower (``model.visual.*``) is
  converted too: ``dayzero.convert.name_map_vision.composite_name_map`` adds its recipes to
  each of these spellings.
- Kimi-Linear: the published spelling (``self_attn.q_conv1d`` / ``k_conv1d`` / ``v_conv1d``,
  ``self_attn.f_a_proj`` / ``dt_bias`` / ``A_log``, MoE under ``block_sparse_moe.`` with experts
  ``w1`` / ``w3`` / ``w2``, the dense layer under ``mlp.``); transformers 5.24's ``save_pretrained``
  (the same, but its dense layer renamed to ``block_sparse_moe.`` too); HF's in-memory names
  (one ``conv1d`` over q|k|v, ``self_attn.forget_gate.*``, ``mlp.`` with fused experts).

The multi-token-prediction module of Qwen3-Next / Qwen3.5 (``mtp.*``) is skipped, as HF's
``_keys_to_ignore_on_load_unexpected`` skips it. FP8 checkpoints (Qwen3-Next-80B-A3B-*-FP8,
Qwen3.5-*-FP8: float8_e4m3fn weights with ``weight_scale_inv`` 128 x 128 blocks) reach these
recipes through ``dayzero.convert.fp8.Fp8DequantReader`` under their own names and shapes.

Layouts (PyTorch Linear weights are [out, in]; dayzero keeps the input first): see
``dayzero.model.linear_weights`` for the linear layers and ``dayzero.convert.transforms_linear``
for how the fused tensors are taken apart. Zero-centred norm weights (Qwen) are stored as
they are: the model adds ``norm_weight_offset``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from dayzero.convert import transforms as T
from dayzero.convert import transforms_linear as TL
from dayzero.convert.name_map import _HF_IGNORED, Combine, NameMap, Recipe, _hf_mla
from dayzero.model.config import Family, ModelConfig

# Tensors of the multi-token-prediction module (Qwen).
_MTP_PREFIX = "mtp."


def _heads_in(heads: int, head_dim: int) -> tuple:
    return (partial(T.split_heads_in, heads=heads, head_dim=head_dim),)


def _heads_out(heads: int, head_dim: int) -> tuple:
    return (partial(T.split_heads_out, heads=heads, head_dim=head_dim),)


def _dense(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """A dense SwiGLU ``{src}{gate,up,down}_proj.weight`` -> ``{dst}gate`` ... (input first)."""
    D, F = c.hidden_size, c.intermediate_size
    return [Recipe(dst + "gate", src + "gate_proj.weight", (F, D), (T.transpose,)),
            Recipe(dst + "up", src + "up_proj.weight", (F, D), (T.transpose,)),
            Recipe(dst + "down", src + "down_proj.weight", (D, F), (T.transpose,))]


def _experts(c: ModelConfig, src: str, dst: str, fused: bool, names: tuple[str, str, str]) -> list[Recipe]:
    """The routed experts under ``src``: fused ``gate_up_proj`` / ``down_proj``, or one tensor per
    expert ``{e}.{name}.weight`` (``names``: gate, up, down) stacked expert-major."""
    D, E, F = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    if fused:
        half = lambda h: (partial(T.split_gate_up, half=h),)  # noqa: E731
        return [Recipe(dst + "gate", src + "gate_up_proj", (E, 2 * F, D), half(0)),
                Recipe(dst + "up", src + "gate_up_proj", (E, 2 * F, D), half(1)),
                Recipe(dst + "down", src + "down_proj", (E, D, F), (T.transpose_experts,))]
    stack = lambda name: tuple(f"{src}{e}.{name}.weight" for e in range(E))  # noqa: E731
    return [Recipe(dst + leaf, stack(name), shape, (T.transpose,), Combine.STACK)
            for leaf, name, shape in zip(("gate", "up", "down"), names, ((F, D), (F, D), (D, F)))]


# ---- Qwen3-Next / Qwen3.5 --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _QwenSpelling:
    prefix: str  # the text model's prefix: "model." or "model.language_model."
    fused_experts: bool


def _gated_delta(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """A Gated DeltaNet layer (``linear_attn.``): Qwen3-Next's fused in_proj_qkvz / in_proj_ba or
    Qwen3.5's in_proj_qkv / _z / _b / _a; conv1d over q|k|v (in that order, each head-major),
    A_log, dt_bias, the gated norm and out_proj."""
    lc, D = c.linear, c.hidden_size
    Hk, Hv, dk, dv, W = lc.num_k_heads, lc.num_v_heads, lc.k_head_dim, lc.v_head_dim, lc.conv_kernel
    C = 2 * Hk * dk + Hv * dv
    conv = lambda start, h, d: (partial(TL.conv_taps, start=start, heads=h, head_dim=d),)  # noqa: E731
    r = [
        Recipe(dst + "conv_q", src + "conv1d.weight", (C, 1, W), conv(0, Hk, dk)),
        Recipe(dst + "conv_k", src + "conv1d.weight", (C, 1, W), conv(Hk * dk, Hk, dk)),
        Recipe(dst + "conv_v", src + "conv1d.weight", (C, 1, W), conv(2 * Hk * dk, Hv, dv)),
        Recipe(dst + "A_log", src + "A_log", (Hv,)),
        Recipe(dst + "dt_bias", src + "dt_bias", (Hv,)),
        Recipe(dst + "norm", src + "norm.weight", (dv,)),
        Recipe(dst + "o", src + "out_proj.weight", (D, Hv * dv), _heads_out(Hv, dv)),
    ]
    if c.family is Family.QWEN3_NEXT:
        qkvz, shape = src + "in_proj_qkvz.weight", (2 * Hk * dk + 2 * Hv * dv, D)
        part = lambda p: (partial(TL.qkvz_part, k_heads=Hk, k_dim=dk, v_heads=Hv, v_dim=dv, part=p),)  # noqa: E731
        ba = lambda p: (partial(TL.ba_part, k_heads=Hk, v_heads=Hv, part=p),)  # noqa: E731
        return r + [Recipe(dst + leaf, qkvz, shape, part(p)) for leaf, p in
                    (("q", "q"), ("k", "k"), ("v", "v"), ("gate", "z"))] + [
            Recipe(dst + "b", src + "in_proj_ba.weight", (2 * Hv, D), ba("b")),
            Recipe(dst + "a", src + "in_proj_ba.weight", (2 * Hv, D), ba("a")),
        ]
    qkv = src + "in_proj_qkv.weight"
    block = lambda start, h, d: (partial(TL.rows, start=start, stop=start + h * d),) + _heads_in(h, d)  # noqa: E731
    return r + [
        Recipe(dst + "q", qkv, (C, D), block(0, Hk, dk)),
        Recipe(dst + "k", qkv, (C, D), block(Hk * dk, Hk, dk)),
        Recipe(dst + "v", qkv, (C, D), block(2 * Hk * dk, Hv, dv)),
        Recipe(dst + "gate", src + "in_proj_z.weight", (Hv * dv, D), _heads_in(Hv, dv)),
        Recipe(dst + "b", src + "in_proj_b.weight", (Hv, D), (T.transpose,)),
        Recipe(dst + "a", src + "in_proj_a.weight", (Hv, D), (T.transpose,)),
    ]


def _gated_attention(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """Full attention (``self_attn.``): q_proj holds per head [query | output gate]; q/k norms [H]."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    gated = lambda p: (partial(TL.gated_query, heads=N, head_dim=H, part=p),)  # noqa: E731
    return [
        Recipe(dst + "q", src + "q_proj.weight", (2 * N * H, D), gated(0)),
        Recipe(dst + "gate", src + "q_proj.weight", (2 * N * H, D), gated(1)),
        Recipe(dst + "k", src + "k_proj.weight", (K * H, D), _heads_in(K, H)),
        Recipe(dst + "v", src + "v_proj.weight", (K * H, D), _heads_in(K, H)),
        Recipe(dst + "o", src + "o_proj.weight", (D, N * H), _heads_out(N, H)),
        Recipe(dst + "q_norm", src + "q_norm.weight", (H,)),
        Recipe(dst + "k_norm", src + "k_norm.weight", (H,)),
    ]


def _qwen_moe(c: ModelConfig, src: str, dst: str, fused: bool) -> list[Recipe]:
    """Router ``gate``, the experts, the shared expert and its gate ``shared_expert_gate`` [1, D]."""
    D, E, S = c.hidden_size, c.moe.num_experts, c.moe.shared_width
    return [
        Recipe(dst + "router", src + "gate.weight", (E, D), (T.transpose,)),
        Recipe(dst + "shared_gate", src + "shared_expert_gate.weight", (1, D), (TL.first_row,)),
        Recipe(dst + "shared/gate", src + "shared_expert.gate_proj.weight", (S, D), (T.transpose,)),
        Recipe(dst + "shared/up", src + "shared_expert.up_proj.weight", (S, D), (T.transpose,)),
        Recipe(dst + "shared/down", src + "shared_expert.down_proj.weight", (D, S), (T.transpose,)),
    ] + _experts(c, src + "experts.", dst, fused, ("gate_proj", "up_proj", "down_proj"))


def _model_ends(c: ModelConfig, prefix: str) -> list[Recipe]:
    """The embedding, the final norm and (untied) the output head, under ``prefix``."""
    D, V = c.hidden_size, c.vocab_size
    r = [Recipe("embed", prefix + "embed_tokens.weight", (V, D)), Recipe("final_norm", prefix + "norm.weight", (D,))]
    if not c.tie_word_embeddings:
        r.append(Recipe("lm_head", "lm_head.weight", (V, D), (T.transpose,)))
    return r


def _layer_norms(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """A decoder layer's two pre-norms."""
    D = c.hidden_size
    return [Recipe(dst + "attn_norm", src + "input_layernorm.weight", (D,)),
            Recipe(dst + "mlp_norm", src + "post_attention_layernorm.weight", (D,))]


def _qwen_recipes(c: ModelConfig, s: _QwenSpelling) -> tuple[Recipe, ...]:
    p = s.prefix
    r = _model_ends(c, p)
    for i in range(c.num_layers):
        src, dst = f"{p}layers.{i}.", f"layers/{i}/"
        r += _layer_norms(c, src, dst)
        if c.is_linear_layer(i):
            r += _gated_delta(c, src + "linear_attn.", dst + "attn/")
        else:
            r += _gated_attention(c, src + "self_attn.", dst + "attn/")
        if c.is_moe_layer(i):
            r += _qwen_moe(c, src + "mlp.", dst + "mlp/", s.fused_experts)
        else:
            r += _dense(c, src + "mlp.", dst + "mlp/")
    return tuple(r)


def _qwen_spellings(c: ModelConfig) -> list[_QwenSpelling]:
    """The spellings to try, the published one first (problems are reported against it)."""
    if c.family is Family.QWEN3_NEXT:
        return [_QwenSpelling("model.", False), _QwenSpelling("model.", True)]
    prefixes = ("model.language_model.", "model.")
    if c.moe is None:
        return [_QwenSpelling(p, False) for p in prefixes]
    return [_QwenSpelling(p, fused) for p in prefixes for fused in (True, False)]


# ---- Kimi-Linear ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _KimiSpelling:
    split_conv: bool  # q_conv1d / k_conv1d / v_conv1d, else one conv1d over q|k|v
    forget_gate: str  # prefix of f_a_proj, f_b_proj, dt_bias, A_log under self_attn.
    moe_block: str  # the sparse layers' block
    dense_block: str  # the dense layers' block
    fused_experts: bool  # experts.gate_up_proj / down_proj, else experts.{e}.w1 / w3 / w2


_KIMI_PUBLISHED = _KimiSpelling(True, "", "block_sparse_moe.", "mlp.", False)
_KIMI_SAVED = dataclasses.replace(_KIMI_PUBLISHED, dense_block="block_sparse_moe.")
_KIMI_IN_MEMORY = _KimiSpelling(False, "forget_gate.", "mlp.", "mlp.", True)


def _kda(c: ModelConfig, src: str, dst: str, s: _KimiSpelling) -> list[Recipe]:
    """A Kimi Delta Attention layer (``self_attn.``): q/k/v, the short convolutions, the decay
    (f_a_proj, f_b_proj, dt_bias [H*d], A_log [1,1,H,1]), beta's b_proj, the output gate (g_a_proj,
    g_b_proj), o_norm and o_proj."""
    lc, D = c.linear, c.hidden_size
    H, d, W = lc.num_v_heads, lc.v_head_dim, lc.conv_kernel
    fg = src + s.forget_gate
    r = [
        Recipe(dst + name, f"{src}{name}_proj.weight", (H * d, D), _heads_in(H, d)) for name in ("q", "k", "v")
    ] + [
        Recipe(dst + "b", src + "b_proj.weight", (H, D), (T.transpose,)),
        Recipe(dst + "decay_a", fg + "f_a_proj.weight", (d, D), (T.transpose,)),
        Recipe(dst + "decay_b", fg + "f_b_proj.weight", (H * d, d), _heads_in(H, d)),
        Recipe(dst + "dt_bias", fg + "dt_bias", (H * d,), (partial(T.split_bias, heads=H, head_dim=d),)),
        Recipe(dst + "A_log", fg + "A_log", (1, 1, H, 1), (TL.per_head,)),
        Recipe(dst + "gate_a", src + "g_a_proj.weight", (d, D), (T.transpose,)),
        Recipe(dst + "gate_b", src + "g_b_proj.weight", (H * d, d), _heads_in(H, d)),
        Recipe(dst + "norm", src + "o_norm.weight", (d,)),
        Recipe(dst + "o", src + "o_proj.weight", (D, H * d), _heads_out(H, d)),
    ]
    for k, name in enumerate(("q", "k", "v")):
        if s.split_conv:
            one = partial(TL.conv_taps, start=0, heads=H, head_dim=d)
            r.append(Recipe(dst + f"conv_{name}", f"{src}{name}_conv1d.weight", (H * d, 1, W), (one,)))
        else:
            part = partial(TL.conv_taps, start=k * H * d, heads=H, head_dim=d)
            r.append(Recipe(dst + f"conv_{name}", src + "conv1d.weight", (3 * H * d, 1, W), (part,)))
    return r


def _kimi_moe(c: ModelConfig, src: str, dst: str, s: _KimiSpelling) -> list[Recipe]:
    """Router (and its selection bias), the shared experts, the routed experts."""
    D, E, S = c.hidden_size, c.moe.num_experts, c.moe.shared_width
    b = src + s.moe_block
    return [
        Recipe(dst + "router", b + "gate.weight", (E, D), (T.transpose,)),
        Recipe(dst + "score_bias", b + "gate.e_score_correction_bias", (E,)),
        Recipe(dst + "shared/gate", b + "shared_experts.gate_proj.weight", (S, D), (T.transpose,)),
        Recipe(dst + "shared/up", b + "shared_experts.up_proj.weight", (S, D), (T.transpose,)),
        Recipe(dst + "shared/down", b + "shared_experts.down_proj.weight", (D, S), (T.transpose,)),
    ] + _experts(c, b + "experts.", dst, s.fused_experts, ("w1", "w3", "w2"))


def _kimi_recipes(c: ModelConfig, s: _KimiSpelling) -> tuple[Recipe, ...]:
    r = _model_ends(c, "model.")
    for i in range(c.num_layers):
        src, dst = f"model.layers.{i}.", f"layers/{i}/"
        r += _layer_norms(c, src, dst)
        # Latent attention as DeepSeek-V3's (q_proj or the q LoRA, kv_a / kv_b, o_proj).
        r += _kda(c, src + "self_attn.", dst + "attn/", s) if c.is_linear_layer(i) else _hf_mla(c, src, dst, i)
        if c.is_moe_layer(i):
            r += _kimi_moe(c, src, dst + "mlp/", s)
        else:
            r += _dense(c, src + s.dense_block, dst + "mlp/")
    return tuple(r)


def linear_name_map(c: ModelConfig) -> NameMap:
    """The map for a Qwen3-Next, Qwen3.5 or Kimi-Linear checkpoint in any of its spellings
    (module docstring), the published one first."""
    qwen = c.family in (Family.QWEN3_NEXT, Family.QWEN3_5, Family.QWEN3_5_MOE)

    def ignored(name: str) -> bool:
        if _HF_IGNORED.search(name) or (c.tie_word_embeddings and name == "lm_head.weight"):
            return True
        return qwen and name.startswith(_MTP_PREFIX)  # HF skips the MTP module too

    if qwen:
        layouts = [_qwen_recipes(c, s) for s in _qwen_spellings(c)]
    elif c.family is Family.KIMI_LINEAR:
        layouts = [_kimi_recipes(c, s) for s in (_KIMI_PUBLISHED, _KIMI_SAVED, _KIMI_IN_MEMORY)]
    else:
        raise ValueError(f"no linear-attention name map for the {c.family.value} family")
    return NameMap(layouts[0], ignored, tuple(layouts[1:]))
