"""Name maps: which source tensors feed which leaf of the weight tree, and through which transforms.

A map is a list of :class:`Recipe`, one per target leaf (the leaf paths of
``dayzero.model.weights.named_leaves(abstract_weights(config))``, e.g. ``layers/3/attn/q``),
plus a predicate for source tensors that are deliberately not used. Most leaves come from one
source tensor; a stacked expert leaf [E, ...] comes from E per-expert tensors (``Combine.STACK``).
A map may also carry alternative layouts of the same leaves (HF's fused expert tensors beside
the per-expert ones of published checkpoints); the one whose tensors the source has is used.
:func:`plan` checks a source against a map before any data is read: every target leaf has
existing source tensors of the expected shape, and every source tensor is used or explicitly
ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from functools import partial
from typing import Callable, Iterable, Sequence

import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert.errors import ConvertError
from dayzero.model.config import Family, ModelConfig
from dayzero.model.weights import abstract_weights, named_leaves

Transform = Callable[[np.ndarray], np.ndarray]


class Combine(enum.Enum):
    """How a recipe's transformed source tensors make its leaf."""

    ONLY = "only"  # one source tensor is the leaf
    STACK = "stack"  # source i becomes leaf[i] (experts stacked expert-major)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one target leaf is made: each of ``sources`` (all of ``source_shape``) goes through
    ``steps`` in order, then ``combine`` puts the results together.

    ``sources`` may be given as one name, for the common one-tensor leaf.
    """

    target: str
    sources: tuple[str, ...] | str
    source_shape: tuple[int, ...]
    steps: tuple[Transform, ...] = (T.identity,)
    combine: Combine = Combine.ONLY

    def __post_init__(self):
        if isinstance(self.sources, str):
            object.__setattr__(self, "sources", (self.sources,))
        if self.combine is Combine.ONLY and len(self.sources) != 1:
            raise ValueError(f"recipe for {self.target}: Combine.ONLY takes one source, got {len(self.sources)}")
        if not self.sources:
            raise ValueError(f"recipe for {self.target} has no sources")

    @property
    def source(self) -> str:
        """The one source tensor of a ``Combine.ONLY`` recipe (use ``sources`` for any recipe)."""
        if len(self.sources) != 1:
            raise ValueError(f"recipe for {self.target} has {len(self.sources)} sources; read .sources")
        return self.sources[0]

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Run the value transforms on one source tensor that already passed the shape check."""
        for step in self.steps:
            x = step(x)
        return x


@dataclasses.dataclass(frozen=True)
class NameMap:
    """The recipes for every target leaf plus the rule for deliberately unused source tensors.

    ``alternatives``: other complete recipe sets for the same leaves, each a different source
    layout (e.g. experts fused into one tensor). :meth:`layout_for` picks the one a source has.
    """

    recipes: tuple[Recipe, ...]
    is_ignored: Callable[[str], bool]
    alternatives: tuple[tuple[Recipe, ...], ...] = ()

    def layout_for(self, names: Iterable[str],
                   shape_of: Callable[[str], tuple[int, ...]] | None = None) -> tuple[Recipe, ...]:
        """The first layout whose every source tensor is in ``names`` (and, given ``shape_of``,
        has the recipe's shape: two layouts may spell a tensor alike and differ in its layout,
        as Qwen3-VL-MoE's experts); else the first whose names are all there; else the main one
        (so that problems are reported against the layout of published checkpoints)."""
        names = set(names)
        layouts = (self.recipes, *self.alternatives)
        named = [recipes for recipes in layouts if all(s in names for r in recipes for s in r.sources)]
        for recipes in named if shape_of is not None else ():
            if all(tuple(shape_of(s)) == r.source_shape for r in recipes for s in r.sources):
                return recipes
        return named[0] if named else self.recipes


def source_tensors(recipes: Iterable[Recipe]) -> list[tuple[str, Recipe]]:
    """Every (source tensor, recipe that reads it) pair, in recipe order."""
    return [(s, r) for r in recipes for s in r.sources]


def group_of(target: str) -> str:
    """Checkpoint group of a leaf: ``layer_003`` for ``layers/3/...``, ``vision`` for the vision
    tower's ``vision/...``, else ``globals``."""
    parts = target.split("/")
    if parts[0] == "vision":
        return "vision"
    return f"layer_{int(parts[1]):03d}" if parts[0] == "layers" else "globals"


def key_in_group(target: str) -> tuple[str, ...]:
    """The leaf's key path inside its group (``("attn", "q")`` for ``layers/3/attn/q``,
    ``("blocks", "0", "attn", "q")`` for ``vision/blocks/0/attn/q``)."""
    parts = tuple(target.split("/"))
    return parts[2:] if parts[0] == "layers" else parts[1:] if parts[0] == "vision" else parts


# --- Hugging Face (llama / mistral / qwen2 / qwen3 / mixtral / qwen3_moe / deepseek / glm4_moe /
# minimax_m2 / gpt_oss) ---

_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a derived buffer old checkpoints saved

LayerMLP = Callable[[ModelConfig, str, str], list[Recipe]]  # (config, source prefix, target prefix)


def _hf_dense_mlp(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    D, F = c.hidden_size, c.intermediate_size
    return [
        Recipe(dst + "mlp/gate", src + "mlp.gate_proj.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/up", src + "mlp.up_proj.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/down", src + "mlp.down_proj.weight", (D, F), (T.transpose,)),
    ]


@dataclasses.dataclass(frozen=True)
class _ExpertNames:
    """Where a family's per-expert tensors live: ``{block}.gate.weight`` (router) and
    ``{block}.experts.{e}.{gate|up|down}.weight``."""

    block: str
    gate: str
    up: str
    down: str


_PER_EXPERT_NAMES = {
    Family.MIXTRAL: _ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
    Family.QWEN3_MOE: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.DEEPSEEK_V3: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.KIMI_K2: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.DEEPSEEK_V32: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.GLM_MOE_DSA: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.GLM4_MOE: _ExpertNames("mlp", "gate_proj", "up_proj", "down_proj"),
    Family.MINIMAX_M2: _ExpertNames("block_sparse_moe", "w1", "w3", "w2"),
}


def _score_bias_name(c: ModelConfig, block: str) -> str:
    """Where the selection bias lives under ``block``: DeepSeek's in the router
    (``mlp.gate.e_score_correction_bias``), MiniMax-M2's beside it (``block_sparse_moe.`` or, in
    transformers 5's fused layout, ``mlp.e_score_correction_bias``)."""
    owner = block if c.family is Family.MINIMAX_M2 else f"{block}.gate"
    return f"{owner}.e_score_correction_bias"


def _deepseek_router_extras(c: ModelConfig, src: str, dst: str, block: str = "mlp") -> list[Recipe]:
    """The selection bias (see :func:`_score_bias_name`; ``block`` is the MoE block's name in this
    layout) and DeepSeek-V3's shared experts, stored alike in the per-expert and fused layouts."""
    r = []
    if c.moe.score_bias:
        r.append(Recipe(dst + "mlp/score_bias", _score_bias_name(c, src + block), (c.moe.num_experts,)))
    if c.moe.shared_experts:
        D, F = c.hidden_size, c.moe.shared_experts * c.moe.intermediate_size
        for name, shape in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
            r.append(Recipe(dst + f"mlp/shared/{name}", src + f"mlp.shared_experts.{name}_proj.weight", shape,
                            (T.transpose,)))
    return r


def _hf_experts(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """Per-expert tensors, as published checkpoints (Mixtral-8x7B, Qwen3-30B-A3B) and
    transformers' default ``save_pretrained`` store them; each stacked expert-major."""
    n, D, E, F = _PER_EXPERT_NAMES[c.family], c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    block = src + n.block

    def per_expert(name: str) -> tuple[str, ...]:
        return tuple(f"{block}.experts.{e}.{name}.weight" for e in range(E))

    return [
        Recipe(dst + "mlp/router", block + ".gate.weight", (E, D), (T.transpose,)),
        Recipe(dst + "mlp/gate", per_expert(n.gate), (F, D), (T.transpose,), Combine.STACK),
        Recipe(dst + "mlp/up", per_expert(n.up), (F, D), (T.transpose,), Combine.STACK),
        Recipe(dst + "mlp/down", per_expert(n.down), (D, F), (T.transpose,), Combine.STACK),
    ] + _deepseek_router_extras(c, src, dst, n.block)


def _hf_fused_experts(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """transformers 5's in-memory layout, which ``save_pretrained(save_original_format=False)``
    writes for both families: router ``mlp.gate.weight`` [E,D], ``mlp.experts.gate_up_proj``
    [E,2F,D] (gate rows first) and ``mlp.experts.down_proj`` [E,D,F]."""
    D, E, F = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    gate_up = src + "mlp.experts.gate_up_proj"
    half = lambda h: (partial(T.split_gate_up, half=h),)  # noqa: E731
    return [
        Recipe(dst + "mlp/router", src + "mlp.gate.weight", (E, D), (T.transpose,)),
        Recipe(dst + "mlp/gate", gate_up, (E, 2 * F, D), half(0)),
        Recipe(dst + "mlp/up", gate_up, (E, 2 * F, D), half(1)),
        Recipe(dst + "mlp/down", src + "mlp.experts.down_proj", (E, D, F), (T.transpose_experts,)),
    ] + _deepseek_router_extras(c, src, dst)


def _hf_mla(c: ModelConfig, src: str, dst: str, i: int) -> list[Recipe]:
    """HF deepseek_v3 latent attention of layer ``i``: q_a_proj/q_a_layernorm/q_b_proj (or q_proj),
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj (split into k_up and v_up), o_proj; the
    indexer with sparse attention, except on GLM-5's shared layers (which have none)."""
    m, D, N = c.mla, c.hidden_size, c.num_heads
    Q, L, P, R, V = m.q_lora_rank, m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_head_dim
    attn = src + "self_attn."
    heads_in = (partial(T.split_heads_in, heads=N, head_dim=P + R),)
    kv_b = lambda part: (partial(T.split_kv_up, heads=N, nope_dim=P, part=part),)  # noqa: E731
    r = [
        Recipe(dst + "attn/kv_a", attn + "kv_a_proj_with_mqa.weight", (L + R, D), (T.transpose,)),
        Recipe(dst + "attn/kv_a_norm", attn + "kv_a_layernorm.weight", (L,)),
        Recipe(dst + "attn/k_up", attn + "kv_b_proj.weight", (N * (P + V), L), kv_b(0)),
        Recipe(dst + "attn/v_up", attn + "kv_b_proj.weight", (N * (P + V), L), kv_b(1)),
        Recipe(dst + "attn/o", attn + "o_proj.weight", (D, N * V), (partial(T.split_heads_out, heads=N, head_dim=V),)),
    ]
    if Q is None:
        return r + [Recipe(dst + "attn/q", attn + "q_proj.weight", (N * (P + R), D), heads_in)]
    if c.dsa is not None and c.dsa.runs_indexer(i):
        r += _hf_indexer(c, attn + "indexer.", dst + "attn/indexer/")
    return r + [
        Recipe(dst + "attn/q_a", attn + "q_a_proj.weight", (Q, D), (T.transpose,)),
        Recipe(dst + "attn/q_a_norm", attn + "q_a_layernorm.weight", (Q,)),
        Recipe(dst + "attn/q_b", attn + "q_b_proj.weight", (N * (P + R), Q), heads_in),
    ]


def _hf_indexer(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """HF deepseek_v32's ``self_attn.indexer``: wq_b [I*J, Q], wk [J, D], k_norm (a LayerNorm:
    weight and bias) [J], weights_proj [I, D]."""
    D, Q, I, J = c.hidden_size, c.mla.q_lora_rank, c.dsa.heads, c.dsa.head_dim
    return [
        Recipe(dst + "q_b", src + "wq_b.weight", (I * J, Q), (partial(T.split_heads_in, heads=I, head_dim=J),)),
        Recipe(dst + "k", src + "wk.weight", (J, D), (T.transpose,)),
        Recipe(dst + "k_norm", src + "k_norm.weight", (J,)),
        Recipe(dst + "k_norm_bias", src + "k_norm.bias", (J,)),
        Recipe(dst + "head_weights", src + "weights_proj.weight", (I, D), (T.transpose,)),
    ]


def _hf_gqa(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """HF q/k/v/o projections, with the biases and q/k norms the family has."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    heads_in = lambda n: (partial(T.split_heads_in, heads=n, head_dim=H),)  # noqa: E731
    r = [
        Recipe(dst + "attn/q", src + "self_attn.q_proj.weight", (N * H, D), heads_in(N)),
        Recipe(dst + "attn/k", src + "self_attn.k_proj.weight", (K * H, D), heads_in(K)),
        Recipe(dst + "attn/v", src + "self_attn.v_proj.weight", (K * H, D), heads_in(K)),
        Recipe(dst + "attn/o", src + "self_attn.o_proj.weight", (D, N * H),
               (partial(T.split_heads_out, heads=N, head_dim=H),)),
    ]
    if c.qkv_bias:
        for name, n in (("q", N), ("k", K), ("v", K)):
            r.append(Recipe(dst + f"attn/{name}_bias", src + f"self_attn.{name}_proj.bias", (n * H,),
                            (partial(T.split_bias, heads=n, head_dim=H),)))
    if c.o_bias:
        r.append(Recipe(dst + "attn/o_bias", src + "self_attn.o_proj.bias", (D,)))
    if c.qk_norm_all_heads:  # one weight over all heads [n*H], kept head-split [n,H] like q and k
        for name, n in (("q", N), ("k", K)):
            r.append(Recipe(dst + f"attn/{name}_norm", src + f"self_attn.{name}_norm.weight", (n * H,),
                            (partial(T.split_bias, heads=n, head_dim=H),)))
    elif c.qk_norm:
        r.append(Recipe(dst + "attn/q_norm", src + "self_attn.q_norm.weight", (H,)))
        r.append(Recipe(dst + "attn/k_norm", src + "self_attn.k_norm.weight", (H,)))
    if c.attention_sinks:  # gpt-oss: one logit per query head
        r.append(Recipe(dst + "attn/sinks", src + "self_attn.sinks", (N,)))
    return r


def _hf_gpt_oss_experts(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """HF gpt_oss's MoE block (one layout, published and ``save_pretrained`` alike): router
    ``mlp.router.weight`` [E,D] and ``.bias`` [E]; ``mlp.experts.gate_up_proj`` [E,D,2F] already
    input-major, gate and up interleaved along its columns (gate even, up odd), its bias
    ``gate_up_proj_bias`` [E,2F] alike; ``down_proj`` [E,F,D] and ``down_proj_bias`` [E,D]."""
    D, E, F = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    experts = src + "mlp.experts."
    part = lambda p: (partial(T.deinterleave, axis=-1, part=p),)  # noqa: E731
    return [
        Recipe(dst + "mlp/router", src + "mlp.router.weight", (E, D), (T.transpose,)),
        Recipe(dst + "mlp/router_bias", src + "mlp.router.bias", (E,)),
        Recipe(dst + "mlp/gate", experts + "gate_up_proj", (E, D, 2 * F), part(0)),
        Recipe(dst + "mlp/up", experts + "gate_up_proj", (E, D, 2 * F), part(1)),
        Recipe(dst + "mlp/gate_bias", experts + "gate_up_proj_bias", (E, 2 * F), part(0)),
        Recipe(dst + "mlp/up_bias", experts + "gate_up_proj_bias", (E, 2 * F), part(1)),
        Recipe(dst + "mlp/down", experts + "down_proj", (E, F, D)),
        Recipe(dst + "mlp/down_bias", experts + "down_proj_bias", (E, D)),
    ]


def _hf_layer(c: ModelConfig, i: int, experts: LayerMLP, prefix: str = "model.", src: str | None = None,
              dst: str | None = None) -> list[Recipe]:
    """Decoder layer ``i`` of ``c``, read from ``src`` (default ``{prefix}layers.{i}.``) into
    ``dst`` (default ``layers/{i}/``)."""
    D = c.hidden_size
    src, dst = src or f"{prefix}layers.{i}.", dst or f"layers/{i}/"
    r = [Recipe(dst + "attn_norm", src + "input_layernorm.weight", (D,))]
    r += _hf_mla(c, src, dst, i) if c.mla is not None else _hf_gqa(c, src, dst)
    r.append(Recipe(dst + "mlp_norm", src + "post_attention_layernorm.weight", (D,)))
    return r + (experts if c.is_moe_layer(i) else _hf_dense_mlp)(c, src, dst)


def _hf_recipes(c: ModelConfig, experts: LayerMLP, prefix: str = "model.") -> tuple[Recipe, ...]:
    """The whole text model with the decoder under ``prefix`` (``model.language_model.`` in the
    multimodal files); ``lm_head`` stays at the top level."""
    D, V = c.hidden_size, c.vocab_size
    recipes = [Recipe("embed", prefix + "embed_tokens.weight", (V, D))]
    for i in range(c.num_layers):
        recipes += _hf_layer(c, i, experts, prefix)
    recipes.append(Recipe("final_norm", prefix + "norm.weight", (D,)))
    if not c.tie_word_embeddings:
        recipes.append(Recipe("lm_head", "lm_head.weight", (V, D), (T.transpose,)))
    if c.mtp_kept:  # last, so that a missing main-model tensor is named first
        for k in range(c.mtp_layers):
            recipes += _hf_nextn(c, k, experts, prefix)
    return tuple(recipes)


def _hf_nextn(c: ModelConfig, k: int, experts: LayerMLP, prefix: str) -> list[Recipe]:
    """DeepSeek-V3's MTP module ``k``, stored as layer ``num_layers + k``: ``enorm``, ``hnorm``,
    ``eh_proj`` [D, 2D] (kept input-first), ``shared_head.norm``, and its decoder layer spelt as
    a main layer's (``dayzero.model.mtp``). Its ``embed_tokens`` / ``shared_head.head`` copies
    are not read (:func:`_is_mtp_tensor`)."""
    from dayzero.model.mtp import nextn_block_config

    D = c.hidden_size
    src, dst = f"{prefix}layers.{c.num_layers + k}.", f"mtp/{k}/"
    return [
        Recipe(dst + "enorm", src + "enorm.weight", (D,)),
        Recipe(dst + "hnorm", src + "hnorm.weight", (D,)),
        Recipe(dst + "eh_proj", src + "eh_proj.weight", (D, 2 * D), (T.transpose,)),
        Recipe(dst + "norm", src + "shared_head.norm.weight", (D,)),
    ] + _hf_layer(nextn_block_config(c), 0, experts, src=src, dst=dst + "layer/")


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _is_mtp_tensor(c: ModelConfig, name: str) -> bool:
    """A multi-token-prediction module's tensor that is not converted. GLM-5's modules
    (``num_nextn_predict_layers``; MiniMax-M2's ``num_mtp_modules`` x ``mtp_transformer_layers``
    alike), stored as layers num_layers and up: no drafter runs them, so they are skipped, as
    HF's own ``*ForCausalLM`` skips them when loading; ``dayzero check`` counts them as ignored,
    and the converted config keeps ``mtp_layers``. The modules of ``model.mtp.MTP_FAMILIES``
    (DeepSeek-V3, Kimi-K2, GLM-4.5) are converted when the source has them
    (:func:`with_kept_mtp`), all but their copies of the embedding and the head
    (``embed_tokens``, ``shared_head.head``: the main model's are used).
    A layer past the MTP ones is refused like any unknown tensor."""
    match = _LAYER_INDEX.match(name)
    if not (match and c.num_layers <= int(match.group(1)) < c.num_layers + c.mtp_layers):
        return False
    return not c.mtp_kept or name.endswith((".embed_tokens.weight", ".shared_head.head.weight"))


def with_kept_mtp(c: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """``c`` as a source with tensors ``names`` converts: a source of an MTP family (DeepSeek-V3,
    Kimi-K2, GLM-4.5) with any tensor of its MTP modules keeps them (``mtp_kept``; then every
    one of their tensors is required, with its shape checked); one without them converts
    without (``--speculative mtp`` refuses it)."""
    from dayzero.model.mtp import MTP_FAMILIES

    if c.family not in MTP_FAMILIES or not c.mtp_layers or c.vision is not None:
        return c
    if any(_is_mtp_tensor(c, name) for name in names):
        return dataclasses.replace(c, mtp_kept=True)
    return c


def hf_name_map(c: ModelConfig) -> NameMap:
    """Map for HF ``*ForCausalLM`` state dicts of the llama, mistral, qwen2, qwen3, mixtral,
    qwen3_moe, qwen2_moe, deepseek_v3, kimi_k2, deepseek_v32, glm_moe_dsa, glm4_moe, minimax_m2 and gpt_oss
    families; MoE experts per expert, or fused as an alternative layout (gpt_oss: its one layout).
    With a vision tower (Qwen3-VL, Qwen3.5's multimodal files), the composite model's map: the
    text model's spellings, each with the tower's (``dayzero.convert.name_map_vision``)."""
    if c.vision is not None:
        from dayzero.convert.name_map_vision import composite_name_map

        return composite_name_map(c)

    def ignored(name: str) -> bool:
        # A tied model may still carry a copy of the embedding as lm_head.weight: it is not read.
        return (bool(_HF_IGNORED.search(name)) or (c.tie_word_embeddings and name == "lm_head.weight")
                or _is_mtp_tensor(c, name))

    if c.family is Family.DEEPSEEK_V4:  # three spellings of its own tensors (dayzero.convert.name_map_v4)
        from dayzero.convert.name_map_v4 import v4_name_map

        return v4_name_map(c)
    if c.linear is not None:  # the linear-attention hybrids' spellings (dayzero.convert.name_map_linear)
        from dayzero.convert.name_map_linear import linear_name_map

        return linear_name_map(c)
    if c.family is Family.GPT_OSS:  # its experts have one layout only
        return NameMap(_hf_recipes(c, _hf_gpt_oss_experts), ignored)
    if c.family is Family.QWEN2_MOE:  # Qwen3-Next's MoE block spelling (gated shared expert)
        from dayzero.convert.name_map_linear import _qwen_moe

        block = lambda fused: lambda c, src, dst: _qwen_moe(c, src + "mlp.", dst + "mlp/", fused)  # noqa: E731
        return NameMap(_hf_recipes(c, block(False)), ignored, (_hf_recipes(c, block(True)),))
    fused = (_hf_recipes(c, _hf_fused_experts),) if c.moe is not None else ()
    return NameMap(_hf_recipes(c, _hf_experts), ignored, fused)


# --- GGUF (llama.cpp's llama, qwen2, qwen3, qwen3moe, qwen2moe, minimax-m2 and deepseek2) --------

# The families llama.cpp writes in these layouts (the GGUF source's config says which one a file is).
_GGUF_FAMILIES = (Family.LLAMA, Family.QWEN2, Family.QWEN3, Family.QWEN3_MOE, Family.MINIMAX_M2, Family.QWEN2_MOE,
                  Family.DEEPSEEK_V3)


def _gguf_attention(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """q/k/v/o (``attn_q`` ...), with qwen2's q/k/v biases, qwen3's per-head q/k norms or
    minimax-m2's q/k norms over all heads together ([n*H], kept head-split like q and k).

    llama.cpp permutes the q and k rows of the ``llama`` architecture only (its rotary kernel
    there pairs adjacent elements); the others keep HF's row order (NeoX-style rotary)."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    permuted = c.family is Family.LLAMA

    def heads_in(n: int, permute: bool) -> tuple[Transform, ...]:
        unpermute = (partial(T.llama_cpp_unpermute, heads=n),) if permute else ()
        return unpermute + (partial(T.split_heads_in, heads=n, head_dim=H),)

    r = [
        Recipe(dst + "attn/q", src + "attn_q.weight", (N * H, D), heads_in(N, permuted)),
        Recipe(dst + "attn/k", src + "attn_k.weight", (K * H, D), heads_in(K, permuted)),
        Recipe(dst + "attn/v", src + "attn_v.weight", (K * H, D), heads_in(K, False)),
        Recipe(dst + "attn/o", src + "attn_output.weight", (D, N * H),
               (partial(T.split_heads_out, heads=N, head_dim=H),)),
    ]
    if c.qkv_bias:
        for name, n in (("q", N), ("k", K), ("v", K)):
            r.append(Recipe(dst + f"attn/{name}_bias", src + f"attn_{name}.bias", (n * H,),
                            (partial(T.split_bias, heads=n, head_dim=H),)))
    if c.qk_norm_all_heads:
        for name, n in (("q", N), ("k", K)):
            r.append(Recipe(dst + f"attn/{name}_norm", src + f"attn_{name}_norm.weight", (n * H,),
                            (partial(T.split_bias, heads=n, head_dim=H),)))
    elif c.qk_norm:
        r.append(Recipe(dst + "attn/q_norm", src + "attn_q_norm.weight", (H,)))
        r.append(Recipe(dst + "attn/k_norm", src + "attn_k_norm.weight", (H,)))
    return r


def _gguf_mlp(c: ModelConfig, i: int, src: str, dst: str) -> list[Recipe]:
    """A dense MLP (``ffn_gate`` ...) or, in a sparse layer, the router ``ffn_gate_inp`` [E, D]
    and the experts llama.cpp stores stacked: ``ffn_{gate,up}_exps`` [E, F, D], ``ffn_down_exps``
    [E, D, F] (PyTorch order); minimax-m2's selection bias is ``exp_probs_b.bias`` [E]."""
    D = c.hidden_size
    if not c.is_moe_layer(i):
        F = c.intermediate_size
        return [
            Recipe(dst + "mlp/gate", src + "ffn_gate.weight", (F, D), (T.transpose,)),
            Recipe(dst + "mlp/up", src + "ffn_up.weight", (F, D), (T.transpose,)),
            Recipe(dst + "mlp/down", src + "ffn_down.weight", (D, F), (T.transpose,)),
        ]
    E, F = c.moe.num_experts, c.moe.intermediate_size
    bias = [Recipe(dst + "mlp/score_bias", src + "exp_probs_b.bias", (E,))] if c.moe.score_bias else []
    return bias + _gguf_shared(c, src, dst) + [
        Recipe(dst + "mlp/router", src + "ffn_gate_inp.weight", (E, D), (T.transpose,)),
        Recipe(dst + "mlp/gate", src + "ffn_gate_exps.weight", (E, F, D), (T.transpose_experts,)),
        Recipe(dst + "mlp/up", src + "ffn_up_exps.weight", (E, F, D), (T.transpose_experts,)),
        Recipe(dst + "mlp/down", src + "ffn_down_exps.weight", (E, D, F), (T.transpose_experts,)),
    ]


def _gguf_shared(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """The shared expert ``ffn_{gate,up,down}_shexp`` [S, D] / [D, S] and, with a gate (qwen2moe),
    ``ffn_gate_inp_shexp`` [D] (llama.cpp's converter squeezes HF's [1, D] to one row)."""
    if not c.moe.shared_experts:
        return []
    D, S = c.hidden_size, c.moe.shared_width
    gate = [Recipe(dst + "mlp/shared_gate", src + "ffn_gate_inp_shexp.weight", (D,))] if c.moe.shared_gate else []
    return gate + [
        Recipe(dst + "mlp/shared/gate", src + "ffn_gate_shexp.weight", (S, D), (T.transpose,)),
        Recipe(dst + "mlp/shared/up", src + "ffn_up_shexp.weight", (S, D), (T.transpose,)),
        Recipe(dst + "mlp/shared/down", src + "ffn_down_shexp.weight", (D, S), (T.transpose,)),
    ]


def _gguf_layer(c: ModelConfig, i: int, split_kv_b: bool) -> list[Recipe]:
    D = c.hidden_size
    src, dst = f"blk.{i}.", f"layers/{i}/"
    r = [Recipe(dst + "attn_norm", src + "attn_norm.weight", (D,))]
    if c.mla is not None:  # deepseek2 (dayzero.convert.name_map_gguf_mla)
        from dayzero.convert.name_map_gguf_mla import gguf_mla

        r += gguf_mla(c, src, dst, split_kv_b)
    else:
        r += _gguf_attention(c, src, dst)
    r.append(Recipe(dst + "mlp_norm", src + "ffn_norm.weight", (D,)))
    return r + _gguf_mlp(c, i, src, dst)


def _gguf_recipes(c: ModelConfig, split_kv_b: bool) -> tuple[Recipe, ...]:
    D, V = c.hidden_size, c.vocab_size
    recipes = [Recipe("embed", "token_embd.weight", (V, D))]
    for i in range(c.num_layers):
        recipes += _gguf_layer(c, i, split_kv_b)
    recipes.append(Recipe("final_norm", "output_norm.weight", (D,)))
    if not c.tie_word_embeddings:
        recipes.append(Recipe("lm_head", "output.weight", (V, D), (T.transpose,)))
    return tuple(recipes)


def gguf_name_map(c: ModelConfig) -> NameMap:
    """Map for llama.cpp GGUF files of the ``llama``, ``qwen2``, ``qwen3``, ``qwen3moe``,
    ``qwen2moe``, ``minimax-m2`` and ``deepseek2`` architectures (shapes in [out, in] order, as
    the GGUF reader reports them). deepseek2's key/value up-projection: ``attn_k_b``/``attn_v_b``
    (current llama.cpp), or ``attn_kv_b`` (older files) as the alternative layout."""
    if c.family not in _GGUF_FAMILIES or c.dsa is not None:
        raise ConvertError(f"GGUF files of the {c.family.value} family are not supported; convert its HF directory")
    if c.o_bias or (c.qkv_bias and c.family is Family.LLAMA):
        raise ConvertError(
            f"GGUF {c.family.value} files carry no o_proj bias (nor llama q/k/v biases); the config asks for them"
        )
    older = (_gguf_recipes(c, False),) if c.mla is not None else ()
    return NameMap(_gguf_recipes(c, True), lambda name: False, older)


# --- Checking a source against a map -----------------------------------------------------------


def check_targets(recipes: Sequence[Recipe], config: ModelConfig) -> None:
    """Every leaf of the weight tree is made by exactly one recipe (a bug in a map otherwise).

    Output shapes are checked on the real arrays in the streaming loop, where they are free.
    """
    specs = named_leaves(abstract_weights(config))
    targets = [r.target for r in recipes]
    if sorted(targets) != sorted(specs):
        missing = sorted(set(specs) - set(targets))
        extra = sorted((set(targets) - set(specs)) | {t for t in targets if targets.count(t) > 1})
        raise AssertionError(f"name map out of step with the weight tree: missing {missing}, extra {extra}")


def plan(name_map: NameMap, source_names: Iterable[str], shape_of: Callable[[str], tuple[int, ...]],
         where: str) -> tuple[Recipe, ...]:
    """Check a source against a map before reading any data; return the recipes to run.

    Picks the map's layout that the source has (:meth:`NameMap.layout_for`). Raises
    :class:`ConvertError` naming the first missing tensor, unexpected tensor or wrong shape (in
    the source's own layout). ``where`` names the source in the messages.
    """
    names = set(source_names)
    recipes = name_map.layout_for(names, shape_of)
    wanted = source_tensors(recipes)
    for name, r in wanted:
        if name not in names:
            raise ConvertError(
                f"{where} has no tensor '{name}' (needed for {r.target}); "
                "the checkpoint is incomplete or does not match its config"
            )
    unexpected = sorted(n for n in names - {name for name, _ in wanted} if not name_map.is_ignored(n))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConvertError(
            f"{where} has an unexpected tensor '{unexpected[0]}'{more}; dayzero does not know what it "
            "computes, so this checkpoint is not of the architecture its config declares"
        )
    for name, r in wanted:
        check_shape(r, name, tuple(shape_of(name)), where)
    return recipes


def check_shape(recipe: Recipe, source: str, shape: tuple[int, ...], where: str) -> None:
    """Raise :class:`ConvertError` if a source tensor does not have the shape the config implies."""
    if tuple(shape) != recipe.source_shape:
        raise ConvertError(
            f"tensor '{source}' in {where} has shape {list(shape)}, expected "
            f"{list(recipe.source_shape)} from the config; the config and the weights disagree"
        )
