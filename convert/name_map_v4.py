"""DeepSeek-V4's name map (``dayzero.convert.name_map.hf_name_map`` hands ``deepseek_v4`` here).

One recipe set per spelling of the same tensors, all with the same layouts:

- ``save_pretrained`` (transformers 5's default): its conversion mapping run backwards, i.e.
  DeepSeek's own names under ``model.layers.{i}.`` (``attn.wq_a``, ``ffn.experts.{e}.w1`` ...),
  except ``model.embed_tokens``, ``model.norm``, ``head``, ``model.hc_head.hc_*`` and the
  attention's kv norm written ``attn.norm`` (the reverse of HF's ``.norm.`` -> ``.kv_norm.``);
- DeepSeek's upstream names (``embed``, ``layers.{i}.attn.kv_norm``, ``hc_head_fn`` ...), as
  the published checkpoints spell them, in float or in the published FP8 / FP4 format (the
  readers of ``dayzero.convert.sources`` present each FP8 or FP4 weight under its own name and
  shape, so these recipes serve both);
- HF's in-memory names (``save_pretrained(save_original_format=False)``): ``self_attn.q_a_proj``,
  ``self_attn.compressor.indexer.scorer.weights_proj``, experts fused as ``gate_up_proj``.

Layouts (PyTorch Linear weights are [out, in]; dayzero keeps the input first): q_a [D,Q], q_b
[Q,N,H], kv [D,H], o_b [g*d_g,D], router [D,E], compressor kv/gate [D,m*C] and the indexer's
head_weights [D,I] are transposes (q_b and the indexer's q_b [Q,I,J] split per head); o_a
[g,N*H/g,d_g] is ``wo_a`` [g*d_g,N*H/g] viewed per group and transposed in each; sinks,
position biases (``ape``), norms and the hyper-connection tensors are as stored; per-expert w1 /
w3 / w2 stack into gate / up [E,D,F] and down [E,F,D] (HF's fused ``gate_up_proj`` [E,2F,D] holds
gate rows first); ``tid2eid`` [V,C] is the hash layers' table (the converter stores it as int32).

The multi-token-prediction modules (``mtp.{k}.*``, ``num_nextn_predict_layers`` of them; HF
skips them) are read and kept as ``mtp/{k}/...`` (``dayzero.model.compressed_weights.MTPWeights``), in
DeepSeek's names whatever the spelling of the rest (see :func:`_mtp`); e_proj / h_proj are
transposes, their block is mapped as a main layer is. DeepSeek-V3's MTP layer is kept by `convert/name_map.py` (`model/mtp.py`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Iterable

import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import _HF_IGNORED, Combine, NameMap, Recipe
from dayzero.model.config import CompressKind, ModelConfig
from dayzero.model.compressed_weights import mtp_block_config


@dataclasses.dataclass(frozen=True)
class _Spelling:
    """Where one spelling keeps each tensor (names relative to the prefix in the comment)."""

    layer: str  # layer i's prefix, formatted with i
    embed: str
    norm: str
    head: str
    hc_head: str  # formatted with fn / base / scale
    attn: str  # under the layer
    q_a: str  # under attn (so are the next seven, the compressor and the indexer)
    q_a_norm: str
    q_b: str
    kv: str
    kv_norm: str
    o_a: str
    o_b: str
    sinks: str
    compressor: str
    c_kv: str  # under a compressor (the attention's or the indexer's)
    c_gate: str
    c_bias: str
    c_norm: str
    indexer: str  # the indexer's q_b and head weights live under attn + this
    index_compressor: str  # the indexer's compressor, under attn
    index_q_b: str
    index_weights: str
    attn_norm: str  # under the layer (so are the next five)
    mlp_norm: str
    attn_hc: str  # formatted with fn / base / scale
    mlp_hc: str
    ffn: str
    router: str  # under ffn (so are the next four)
    score_bias: str
    tid2eid: str
    shared: str  # formatted with one of shared_parts
    shared_parts: tuple[str, str, str]  # gate, up, down
    fused_experts: bool  # gate_up_proj / down_proj, else experts.{e}.w1 / w3 / w2


_UPSTREAM = _Spelling(
    layer="layers.{}.", embed="embed.weight", norm="norm.weight", head="head.weight", hc_head="hc_head_{}",
    attn="attn.", q_a="wq_a.weight", q_a_norm="q_norm.weight", q_b="wq_b.weight", kv="wkv.weight",
    kv_norm="kv_norm.weight", o_a="wo_a.weight", o_b="wo_b.weight", sinks="attn_sink", compressor="compressor.",
    c_kv="wkv.weight", c_gate="wgate.weight", c_bias="ape", c_norm="norm.weight", indexer="indexer.",
    index_compressor="indexer.compressor.", index_q_b="wq_b.weight", index_weights="weights_proj.weight",
    attn_norm="attn_norm.weight", mlp_norm="ffn_norm.weight", attn_hc="hc_attn_{}", mlp_hc="hc_ffn_{}",
    ffn="ffn.", router="gate.weight", score_bias="gate.bias", tid2eid="gate.tid2eid",
    shared="shared_experts.{}.weight", shared_parts=("w1", "w3", "w2"), fused_experts=False,
)
_SAVED = dataclasses.replace(
    _UPSTREAM, layer="model.layers.{}.", embed="model.embed_tokens.weight", norm="model.norm.weight",
    hc_head="model.hc_head.hc_{}", kv_norm="norm.weight",
)
_HF = dataclasses.replace(
    _SAVED, head="lm_head.weight", attn="self_attn.", q_a="q_a_proj.weight", q_a_norm="q_a_norm.weight",
    q_b="q_b_proj.weight", kv="kv_proj.weight", kv_norm="kv_norm.weight", o_a="o_a_proj.weight",
    o_b="o_b_proj.weight", sinks="sinks", c_kv="kv_proj.weight", c_gate="gate_proj.weight", c_bias="position_bias",
    c_norm="kv_norm.weight", indexer="compressor.indexer.", index_compressor="compressor.indexer.",
    index_q_b="q_b_proj.weight", index_weights="scorer.weights_proj.weight", attn_norm="input_layernorm.weight",
    mlp_norm="post_attention_layernorm.weight", attn_hc="attn_hc.{}", mlp_hc="ffn_hc.{}", ffn="mlp.",
    score_bias="gate.e_score_correction_bias", shared="shared_experts.{}_proj.weight",
    shared_parts=("gate", "up", "down"), fused_experts=True,
)


def grouped_out(x: np.ndarray, groups: int) -> np.ndarray:
    """``wo_a`` [g*d_g, N*H/g] (HF DeepseekV4GroupedLinear: group k's rows k*d_g ...) -> o_a
    [g, N*H/g, d_g], group k's projection input-first."""
    return x.reshape(groups, -1, x.shape[1]).transpose(0, 2, 1)


def _compressor(c: ModelConfig, src: str, dst: str, s: _Spelling, width: int, overlap: bool,
                ratio: int) -> list[Recipe]:
    """One compressor at ``width`` (m = 2 feature series per token for CSA's overlap, else 1)."""
    D, m = c.hidden_size, 2 if overlap else 1
    return [
        Recipe(dst + "kv", src + s.c_kv, (m * width, D), (T.transpose,)),
        Recipe(dst + "gate", src + s.c_gate, (m * width, D), (T.transpose,)),
        Recipe(dst + "position_bias", src + s.c_bias, (ratio, m * width)),
        Recipe(dst + "norm", src + s.c_norm, (width,)),
    ]


def _attention(c: ModelConfig, i: int, src: str, dst: str, s: _Spelling) -> list[Recipe]:
    """Layer ``i``'s attention: q LoRA, the key=value row, grouped output, sinks; the compressor
    on CSA / HCA layers, the indexer on CSA layers."""
    cc, D, N, H = c.compressed, c.hidden_size, c.num_heads, c.head_dim
    Q, g, dg = cc.q_lora_rank, cc.o_groups, cc.o_lora_rank
    a, t = src + s.attn, dst + "attn/"
    r = [
        Recipe(t + "q_a", a + s.q_a, (Q, D), (T.transpose,)),
        Recipe(t + "q_a_norm", a + s.q_a_norm, (Q,)),
        Recipe(t + "q_b", a + s.q_b, (N * H, Q), (partial(T.split_heads_in, heads=N, head_dim=H),)),
        Recipe(t + "kv", a + s.kv, (H, D), (T.transpose,)),
        Recipe(t + "kv_norm", a + s.kv_norm, (H,)),
        Recipe(t + "o_a", a + s.o_a, (g * dg, N * H // g), (partial(grouped_out, groups=g),)),
        Recipe(t + "o_b", a + s.o_b, (D, g * dg), (T.transpose,)),
        Recipe(t + "sinks", a + s.sinks, (N,)),
    ]
    ratio, csa = cc.ratio(i), cc.kinds[i] is CompressKind.CSA
    if ratio is not None:
        r += _compressor(c, a + s.compressor, t + "compressor/", s, H, csa, ratio)
    if csa:
        I, J = cc.index_heads, cc.index_head_dim
        r += [
            Recipe(t + "indexer/q_b", a + s.indexer + s.index_q_b, (I * J, Q),
                   (partial(T.split_heads_in, heads=I, head_dim=J),)),
            Recipe(t + "indexer/head_weights", a + s.indexer + s.index_weights, (I, D), (T.transpose,)),
        ] + _compressor(c, a + s.index_compressor, t + "indexer/compressor/", s, J, True, ratio)
    return r


def _hyper(c: ModelConfig, name: str, dst: str, outputs: int, scales: int) -> list[Recipe]:
    """A hyper-connection mix: fn [outputs, n*D], base [outputs], scale [scales]."""
    nD = c.hyper.mult * c.hidden_size
    shapes = {"fn": (outputs, nD), "base": (outputs,), "scale": (scales,)}
    return [Recipe(dst + part, name.format(part), shape) for part, shape in shapes.items()]


def _moe(c: ModelConfig, i: int, src: str, dst: str, s: _Spelling) -> list[Recipe]:
    """Router, score bias (top-k layers) or token table (hash layers), shared expert, experts."""
    D, E, F, V, C = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size, c.vocab_size, c.moe.experts_per_token
    f, t = src + s.ffn, dst + "mlp/"
    r = [Recipe(t + "router", f + s.router, (E, D), (T.transpose,))]
    if c.moe.hash_layers and c.moe.hash_layers[i]:
        r.append(Recipe(t + "tid2eid", f + s.tid2eid, (V, C)))
    else:
        r.append(Recipe(t + "score_bias", f + s.score_bias, (E,)))
    for leaf, part, shape in zip(("gate", "up", "down"), s.shared_parts, ((F, D), (F, D), (D, F))):
        r.append(Recipe(t + f"shared/{leaf}", f + s.shared.format(part), shape, (T.transpose,)))
    if s.fused_experts:
        gate_up = f + "experts.gate_up_proj"
        return r + [
            Recipe(t + "gate", gate_up, (E, 2 * F, D), (partial(T.split_gate_up, half=0),)),
            Recipe(t + "up", gate_up, (E, 2 * F, D), (partial(T.split_gate_up, half=1),)),
            Recipe(t + "down", f + "experts.down_proj", (E, D, F), (T.transpose_experts,)),
        ]
    for leaf, part, shape in (("gate", "w1", (F, D)), ("up", "w3", (F, D)), ("down", "w2", (D, F))):
        names = tuple(f"{f}experts.{e}.{part}.weight" for e in range(E))
        r.append(Recipe(t + leaf, names, shape, (T.transpose,), Combine.STACK))
    return r


def _layer(c: ModelConfig, i: int, src: str, dst: str, s: _Spelling) -> list[Recipe]:
    """Decoder layer ``i`` of ``c`` read from under ``src``: norms, attention, mixes, MoE."""
    D, n = c.hidden_size, c.hyper.mult
    r = [Recipe(dst + "attn_norm", src + s.attn_norm, (D,)), Recipe(dst + "mlp_norm", src + s.mlp_norm, (D,))]
    r += _attention(c, i, src, dst, s)
    r += _hyper(c, src + s.attn_hc, dst + "attn_hc/", (2 + n) * n, 3)
    r += _hyper(c, src + s.mlp_hc, dst + "mlp_hc/", (2 + n) * n, 3)
    return r + _moe(c, i, src, dst, s)


# DeepSeek's MTP module k, under "mtp.{k}." in every spelling (HF has no MTP module, so neither
# save_pretrained layout ever holds one; DeepSeek's names are the only ones there are). Sources:
# DeepSeek's inference/model.py ``MTPBlock(Block)`` (e_proj, h_proj, enorm, hnorm, norm as
# Linear(dim, dim) / RMSNorm(dim), hc_head_fn [hc, hc*dim], hc_head_base [hc], hc_head_scale [1],
# on top of the ``Block`` of layer index n_layers: compress_ratios' trailing 0, i.e. sliding
# attention, and a ``Gate`` with a bias since only indices below n_hash_layers hash), as vendored
# in several third-party ports; and the published V4-Flash index as two independent write-ups
# list it: 1,575 tensors under mtp.0. = the sliding block's 1,565 (FP8 weights with their .scale,
# 256 experts x 3 FP4 pairs, gate.weight and gate.bias, no compressor or indexer) + e_proj and
# h_proj (FP8, with .scale) + enorm, hnorm, norm + hc_head_fn / base / scale.
_MTP_PREFIX = "mtp.{}."


def _mtp(c: ModelConfig, k: int) -> list[Recipe]:
    """MTP module ``k`` (:class:`dayzero.model.compressed_weights.MTPWeights`): its block through the very
    recipes of a main layer, of the one-layer config :func:`~dayzero.model.compressed_weights.mtp_block_config`."""
    D, src, dst = c.hidden_size, _MTP_PREFIX.format(k), f"mtp/{k}/"
    r = [Recipe(dst + leaf, src + leaf + ".weight", (D,)) for leaf in ("enorm", "hnorm", "norm")]
    r += [Recipe(dst + leaf, src + leaf + ".weight", (D, D), (T.transpose,)) for leaf in ("e_proj", "h_proj")]
    r += _hyper(c, src + "hc_head_{}", dst + "hc_head/", c.hyper.mult, 1)
    return r + _layer(mtp_block_config(c), 0, src, dst + "layer/", _UPSTREAM)


def _recipes(c: ModelConfig, s: _Spelling) -> tuple[Recipe, ...]:
    D, V, n = c.hidden_size, c.vocab_size, c.hyper.mult
    r = [Recipe("embed", s.embed, (V, D)), Recipe("final_norm", s.norm, (D,))]
    if not c.tie_word_embeddings:
        r.append(Recipe("lm_head", s.head, (V, D), (T.transpose,)))
    r += _hyper(c, s.hc_head, "hc_head/", n, 1)
    for i in range(c.num_layers):
        r += _layer(c, i, s.layer.format(i), f"layers/{i}/", s)
    for k in range(c.mtp_layers):  # last, so that a missing main-model tensor is named first
        r += _mtp(c, k)
    return tuple(r)


def _is_main(r: Recipe) -> bool:
    return not r.target.startswith("mtp/")


@dataclasses.dataclass(frozen=True)
class _V4NameMap(NameMap):
    """A :class:`NameMap` that picks the spelling by the main model's tensors alone: the MTP
    modules are spelt alike in all three, so a checkpoint lacking one is reported against its
    own spelling, naming the missing MTP tensor."""

    def layout_for(self, names: Iterable[str], shape_of=None) -> tuple[Recipe, ...]:
        """The first spelling whose main-model tensors are all in ``names`` (MTP ones included in
        what it returns); else ``save_pretrained``'s. (``shape_of`` is not needed: V4's spellings
        differ by name.)"""
        names = set(names)
        for recipes in (self.recipes, *self.alternatives):
            if all(s in names for r in recipes if _is_main(r) for s in r.sources):
                return recipes
        return self.recipes


def v4_name_map(c: ModelConfig) -> NameMap:
    """The map for a ``deepseek_v4`` checkpoint in any of the three spellings (module docstring),
    ``save_pretrained``'s first (problems are reported against it when none is complete). The
    ``num_nextn_predict_layers`` MTP modules are read and kept (a missing tensor of one is an
    error); tensors of further ``mtp.{k}.`` modules are unexpected, as any unknown tensor."""

    def ignored(name: str) -> bool:
        return bool(_HF_IGNORED.search(name)) or (c.tie_word_embeddings and name in (_SAVED.head, _HF.head))

    return _V4NameMap(_recipes(c, _SAVED), ignored, (_recipes(c, _UPSTREAM), _recipes(c, _HF)))


def expert_dtype(hf_config: dict[str, Any]) -> str | None:
    """How a ``deepseek_v4`` checkpoint stores its routed experts: "fp4" (e2m1 pairs in int8 with
    an e8m0 scale per 32 inputs, ``dayzero.convert.mxfp4.RowFp4Reader``), "fp8", or None (as the
    rest). V4 says it at the top level, V4.1 inside ``quantization_config``; both must agree."""
    q = hf_config.get("quantization_config")
    top, inner = hf_config.get("expert_dtype"), q.get("expert_dtype") if isinstance(q, dict) else None
    if None not in (top, inner) and top != inner:
        raise ConvertError(f"expert_dtype is {top!r} at the top level of config.json and {inner!r} in its "
                           "quantization_config; keep one of them")
    return inner if top is None else top


def refusal(hf_config: dict[str, Any]) -> str | None:
    """Why a ``deepseek_v4`` source cannot be converted (None: it can), decided from config.json
    before any tensor is read: experts stored other than as fp4 or fp8 (DeepSeek's inference code
    also knows int4: uint8 pairs with float32 scales, which no reader decodes), or an MTP module
    whose ``compress_ratios`` entry is not 0 (dayzero keeps MTP blocks of the sliding kind, as
    published; ``dayzero.model.compressed_weights.mtp_block_config``)."""
    if hf_config.get("model_type") != "deepseek_v4":
        return None
    try:
        experts = expert_dtype(hf_config)
    except ConvertError as e:
        return str(e)
    if experts not in (None, "fp4", "fp8"):
        return (f"expert_dtype {experts!r} (DeepSeek-V4's routed experts stored in it) cannot be converted; only "
                "fp4 (e2m1 pairs with e8m0 scales) and fp8 experts are read")
    ratios, layers = hf_config.get("compress_ratios"), hf_config.get("num_hidden_layers")
    mtp = hf_config.get("num_nextn_predict_layers")
    if isinstance(ratios, list) and isinstance(layers, int) and isinstance(mtp, int):
        for k, ratio in enumerate(ratios[layers:layers + mtp]):
            if ratio != 0:
                return (f"compress_ratios gives {ratio!r} for MTP module {k} (entry {layers + k}); dayzero keeps MTP "
                        "modules with sliding attention (0) only, as DeepSeek publishes them")
    return None
