"""Model architecture configuration, parsed strictly from a Hugging Face ``config.json``.

Every key of the source config is either used, explicitly ignored (it does not change what the
network computes at inference), or checked against the one value we support. Anything else is an
error that lists the offending keys: a silently ignored key is how a port ends up subtly wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model config that dayzero cannot run faithfully."""


class Family(enum.Enum):
    """Architecture families; each is a variation of one decoder implementation."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MIXTRAL = "mixtral"
    QWEN3_MOE = "qwen3_moe"
    DEEPSEEK_V3 = "deepseek_v3"
    KIMI_K2 = "kimi_k2"  # Kimi-K2 publishes the DeepSeek-V3 architecture under its own name
    DEEPSEEK_V32 = "deepseek_v32"  # DeepSeek-V3 plus DeepSeek Sparse Attention (see DSAConfig)


@dataclasses.dataclass(frozen=True)
class _Traits:
    """What sets a family apart from plain Llama, as HF's implementation of it behaves."""

    qkv_bias: bool = False  # q/k/v biases even when attention_bias is false (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3)
    slides_by_default: bool = False  # sliding_window applies without use_sliding_window (Mistral)
    windows_from_layer_0: bool = False  # a window applies to every layer; max_window_layers is not read
    moe: bool = False  # sparse Mixture-of-Experts blocks (see MoEConfig)
    mla: bool = False  # multi-head latent attention and DeepSeek-V3 routing (see MLAConfig)
    dsa: bool = False  # a lightning indexer picks the tokens latent attention reads (see DSAConfig)


_TRAITS = {
    Family.LLAMA: _Traits(),
    Family.MISTRAL: _Traits(slides_by_default=True, windows_from_layer_0=True),
    Family.QWEN2: _Traits(qkv_bias=True),
    Family.QWEN3: _Traits(qk_norm=True),
    Family.MIXTRAL: _Traits(slides_by_default=True, windows_from_layer_0=True, moe=True),
    Family.QWEN3_MOE: _Traits(qk_norm=True, windows_from_layer_0=True, moe=True),
    Family.DEEPSEEK_V3: _Traits(moe=True, mla=True),
    Family.KIMI_K2: _Traits(moe=True, mla=True),
    Family.DEEPSEEK_V32: _Traits(moe=True, mla=True, dsa=True),
}


class AttentionKind(enum.Enum):
    """Which attention block a model's layers use (``dayzero.model.transformer.attention_block``
    or ``dayzero.model.mla.mla_block``)."""

    GQA = "gqa"  # grouped-query attention over per-head keys/values (MHA and MQA included)
    MLA = "mla"  # multi-head latent attention: one compressed latent per token (DeepSeek-V3)


class RopeType(enum.Enum):
    """RoPE frequency schemes (names as in HF ``rope_type``)."""

    DEFAULT = "default"
    LINEAR = "linear"
    DYNAMIC = "dynamic"
    LLAMA3 = "llama3"
    YARN = "yarn"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; fields beyond ``theta`` only matter for their ``type``."""

    type: RopeType = RopeType.DEFAULT
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


class RouterScore(enum.Enum):
    """How a router turns its logits into per-expert scores (HF ``scoring_func`` names)."""

    SOFTMAX = "softmax"  # over all E experts (Mixtral, Qwen3-MoE)
    SIGMOID = "sigmoid"  # each expert on its own (DeepSeek-V3)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse Mixture-of-Experts feed-forward blocks: E SwiGLU experts, C of them per token.

    Routing (``dayzero.model.moe.route``): scores from the router logits; each token's C experts
    are those with the largest score (+ the learned bias, when ``score_bias``), taken only from
    its ``groups_per_token`` best expert groups when ``num_groups > 1``; their weights are the
    scores without bias, renormalised to sum 1 if ``renormalize``, times ``routed_scaling``.
    Mixtral and Qwen3-MoE use softmax scores and the defaults below; DeepSeek-V3 uses sigmoid
    scores, a bias, groups, scaling and shared experts.
    """

    num_experts: int  # E
    experts_per_token: int  # C
    intermediate_size: int  # F of one expert
    # Per decoder layer: True for a MoE block, False for the dense MLP of ModelConfig.
    layers: tuple[bool, ...]
    score: RouterScore = RouterScore.SOFTMAX
    # Divide the C chosen weights by their sum (Mixtral always; Qwen3-MoE's norm_topk_prob).
    renormalize: bool = True
    score_bias: bool = False  # e_score_correction_bias: shifts the choice, not the weights
    num_groups: int = 1  # n_group: experts split into this many equal groups
    groups_per_token: int = 1  # topk_group: groups ranked by the sum of their two best scores
    routed_scaling: float = 1.0  # routed_scaling_factor, applied to the routed experts' weights
    shared_experts: int = 0  # n_shared_experts: a dense SwiGLU of width shared_experts * F added

    def __post_init__(self):
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.experts_per_token} must be between 1 and the number of "
                f"experts ({self.num_experts}); fix the config"
            )
        group = self.num_experts // self.num_groups if self.num_groups > 0 else 0
        if self.num_groups < 1 or self.num_experts % self.num_groups or (self.num_groups > 1 and group < 2):
            raise ConfigError(
                f"n_group={self.num_groups} must split the {self.num_experts} experts into equal groups "
                "of at least 2 (a group is ranked by its two best scores)"
            )
        if not 1 <= self.groups_per_token <= self.num_groups or self.experts_per_token > self.groups_per_token * group:
            raise ConfigError(
                f"topk_group={self.groups_per_token} must be between 1 and n_group={self.num_groups}, and "
                f"its groups must hold num_experts_per_tok={self.experts_per_token} experts"
            )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), dimension letters as in DESIGN.md.

    Queries: x -> [q_lora_rank, RMSNorm] -> N heads of nope_dim + rope_dim (directly from x when
    ``q_lora_rank`` is None). Keys/values: x -> a latent of L = ``kv_lora_rank`` (RMSNorm'd) plus
    one rope key of R = ``rope_dim`` shared by all heads; per head, the key is (k_up latent, rope
    key) and the value is v_up latent. Only the latent and the rope key are cached.
    """

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # L
    nope_dim: int  # qk_nope_head_dim: the part of each q/k head without position
    rope_dim: int  # R, qk_rope_head_dim: the rotary part, its key shared by all heads
    v_head_dim: int
    # DeepSeek's checkpoints keep each rotary pair adjacent (x0, x1), (x2, x3), ... (HF's
    # rope_interleave); False: the half-split pairs of Llama.
    rope_interleave: bool = True


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): per layer, a lightning indexer scores every
    visible token for each query and latent attention reads only the ``topk`` best.

    Indexer (``dayzero.model.dsa``): I = ``heads`` queries of width ``head_dim`` from the q LoRA
    latent, one key of ``head_dim`` per token (LayerNorm'd, cached beside the latent row), and a
    per-head weight from the hidden state; the first ``rope_dim`` dims of queries and keys are
    rotated with half-split pairs (not the interleaved pairs of the main attention).
    """

    topk: int  # index_topk: tokens each query attends to
    heads: int  # index_n_heads
    head_dim: int  # index_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (dimension letters as in DESIGN.md).

    ``intermediate_size`` is the width of the dense MLP; layers that ``moe`` marks use experts.
    """

    family: Family
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # Per layer: None for full causal attention, else the sliding window length.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    attention: AttentionKind = AttentionKind.GQA
    mla: MLAConfig | None = None  # set iff attention is MLA; head_dim is then its rope_dim
    dsa: DSAConfig | None = None  # sparse attention over the latent rows (needs mla)
    # Multi-token-prediction modules stored after the last layer (DeepSeek-V3's
    # num_nextn_predict_layers): plain decoding never runs them, the converter skips their tensors.
    mtp_layers: int = 0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; fix the config"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(
                f"{len(self.sliding_windows)} layer types given for {self.num_layers} layers"
            )
        if (self.mla is not None) != (self.attention is AttentionKind.MLA):
            raise ConfigError(f"attention={self.attention.value} needs mla settings iff it is MLA")
        if self.dsa is not None and (self.mla is None or self.mla.q_lora_rank is None
                                     or not self.mla.rope_dim <= self.dsa.head_dim):
            raise ConfigError(
                "sparse attention needs latent attention with a q LoRA (q_lora_rank) and "
                f"index_head_dim={self.dsa.head_dim} >= qk_rope_head_dim"
            )
        if self.moe is not None and len(self.moe.layers) != self.num_layers:
            raise ConfigError(f"{len(self.moe.layers)} MoE layer flags given for {self.num_layers} layers")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has a Mixture-of-Experts block instead of the dense MLP."""
        return self.moe is not None and self.moe.layers[i]

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` reads back exactly."""
        d = dataclasses.asdict(self)
        d["family"] = self.family.value
        d["rope"]["type"] = self.rope.type.value
        d["attention"] = self.attention.value
        if self.moe is not None:
            d["moe"]["score"] = self.moe.score.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_json` (dayzero's own parsed form, not an HF config)."""
        d = dict(d)
        rope = dict(d.pop("rope"))
        rope["type"] = RopeType(rope["type"])
        mla = d.pop("mla", None)
        dsa = d.pop("dsa", None)
        attention = AttentionKind(d.pop("attention", AttentionKind.GQA.value))
        moe = d.pop("moe", None)
        if moe is not None:
            moe = MoEConfig(**{**moe, "score": RouterScore(moe["score"]), "layers": tuple(moe["layers"])})
        return cls(
            family=Family(d.pop("family")),
            rope=RopeConfig(**rope),
            sliding_windows=tuple(d.pop("sliding_windows")),
            eos_token_ids=tuple(d.pop("eos_token_ids")),
            moe=moe,
            attention=attention,
            mla=None if mla is None else MLAConfig(**mla),
            dsa=None if dsa is None else DSAConfig(**dsa),
            **d,
        )


# Keys that do not change what the network computes at inference time.
_IGNORED_KEYS = frozenset(
    {
        "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range",
        "use_cache", "pad_token_id", "attention_dropout", "_name_or_path", "tokenizer_class",
        "output_attentions", "output_hidden_states", "return_dict", "pretraining_tp",
        "is_decoder", "chunk_size_feed_forward", "tie_encoder_decoder", "keys_to_ignore_at_inference",
        "bos_token_id", "eos_token_id",  # read separately: they steer generation, not the forward pass
    }
)

# Keys whose only supported value is the given one (the default in HF).
_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "is_encoder_decoder": (False,),
}


class _Reader:
    """Pops keys from an HF config dict and remembers which ones were looked at."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.seen.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        self.seen.add(key)
        if self.raw.get(key) is None:
            raise ConfigError(f"config.json has no '{key}', which a {self.raw.get('model_type')} model needs")
        return self.raw[key]

    def leftover(self) -> list[str]:
        return sorted(set(self.raw) - self.seen - _IGNORED_KEYS)


def _parse_rope(r: _Reader, head_dim: int, max_pos: int) -> RopeConfig:
    """RoPE from either the transformers-5 ``rope_parameters`` or the older ``rope_scaling``."""
    params = dict(r.get("rope_parameters", {}) or {})
    legacy = dict(r.get("rope_scaling", {}) or {})
    params = {**legacy, **params}
    theta = params.pop("rope_theta", None) or r.get("rope_theta", 10000.0)
    type_name = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if params.pop("partial_rotary_factor", r.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported yet")
    try:
        rope_type = RopeType(type_name)
    except ValueError:
        supported = ", ".join(t.value for t in RopeType)
        raise ConfigError(f"unsupported rope_type '{type_name}'; supported: {supported}") from None
    fields = {f.name for f in dataclasses.fields(RopeConfig)}
    renamed = {"original_max_position_embeddings": "original_max_position"}
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        name = renamed.get(key, key)
        if name not in fields or name in ("type", "theta"):
            raise ConfigError(f"unknown RoPE parameter '{key}' for rope_type '{type_name}'")
        kwargs[name] = value
    if rope_type in (RopeType.LLAMA3, RopeType.YARN):
        kwargs.setdefault(
            "original_max_position", r.get("original_max_position_embeddings", max_pos)
        )
    if rope_type is RopeType.YARN and kwargs.get("factor") is None:
        kwargs["factor"] = max_pos / kwargs["original_max_position"]
    if rope_type is not RopeType.DEFAULT and "factor" not in kwargs:
        raise ConfigError(f"rope_type '{type_name}' needs a 'factor'")
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("attention_factor", "mscale", "mscale_all_dim")}
    return RopeConfig(type=rope_type, theta=float(theta), **kwargs)


def _sliding_windows(r: _Reader, family: Family, num_layers: int) -> tuple[int | None, ...]:
    traits = _TRAITS[family]
    window = r.get("sliding_window")
    layer_types = r.get("layer_types")
    use_sliding = r.get("use_sliding_window", traits.slides_by_default)
    # Read (so never reported as unhandled) even where HF ignores it: see windows_from_layer_0.
    max_window_layers = r.get("max_window_layers", num_layers)
    first_sliding = 0 if traits.windows_from_layer_0 else max_window_layers
    if layer_types is None:
        layer_types = [
            "sliding_attention" if use_sliding and window and i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    windows = []
    for kind in layer_types:
        if kind == "full_attention" or (kind == "indexed_attention" and traits.dsa):
            windows.append(None)  # DeepSeek-V3.2's indexed layers attend causally over all tokens
        elif kind == "sliding_attention":
            if not window:
                raise ConfigError("layer_types has 'sliding_attention' but sliding_window is not set")
            windows.append(int(window))
        else:
            raise ConfigError(f"unsupported layer type '{kind}' in layer_types")
    return tuple(windows)


# MoE keys that only matter for training; reading them changes nothing at inference.
_MOE_TRAINING_ONLY = {
    "router_aux_loss_coef": "weight of the load-balancing loss",
    "output_router_logits": "returns router logits for that loss; the tokens' logits are unchanged",
    "router_jitter_noise": "multiplicative noise HF applies to the router input in training mode only",
}


def _num_experts(r: _Reader) -> int:
    """E: Mixtral's ``num_local_experts``; Qwen's ``num_experts`` (transformers 5 writes the former)."""
    local, named = r.get("num_local_experts"), r.get("num_experts")
    if local is not None and named is not None and local != named:
        raise ConfigError(f"num_local_experts={local} and num_experts={named} disagree; keep one of them")
    value = local if local is not None else named
    if value is None:
        raise ConfigError("config.json has neither 'num_local_experts' nor 'num_experts', which a MoE model needs")
    return int(value)


def _qwen_moe_layers(r: _Reader, num_layers: int) -> tuple[bool, ...]:
    """HF Qwen3-MoE: layer i is sparse iff (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.

    Stricter than HF, which divides by a zero step and silently skips out-of-range indices.
    """
    step = r.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step={step!r} must be a positive integer")
    dense = r.get("mlp_only_layers", [])
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"mlp_only_layers has {bad}, not layer indices of a {num_layers}-layer model")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


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
    for key, expected in derived.items():
        if r.get(key, expected) != expected:
            raise ConfigError(f"{key}={r.raw[key]!r} contradicts the latent attention sizes, which imply {expected}")
    if r.get("attention_bias", False):
        raise ConfigError("attention_bias=true is not supported for latent attention")
    return mla


def _parse_dsa(r: _Reader) -> DSAConfig:
    """The indexer of DeepSeek-V3.2 (defaults: HF DeepseekV32Config's)."""
    dsa = DSAConfig(topk=int(r.get("index_topk", 2048)), heads=int(r.get("index_n_heads", 64)),
                    head_dim=int(r.get("index_head_dim", 128)))
    if min(dsa.topk, dsa.heads, dsa.head_dim) < 1:
        raise ConfigError(f"index_topk, index_n_heads and index_head_dim must be positive, got {dsa}")
    # HF's deepseek_v32 always rotates the main attention's interleaved pairs and has no such key.
    if not r.get("rope_interleave", True):
        raise ConfigError("rope_interleave=false is not supported for deepseek_v32 (its attention is interleaved)")
    return dsa


def fp8_block_size(raw: dict[str, Any]) -> tuple[int, int] | None:
    """The [out, in] block of a fine-grained FP8 checkpoint's ``quantization_config`` (None: none).

    Only DeepSeek's scheme is accepted: float8_e4m3fn weights with one ``weight_scale_inv`` per
    block; dynamic activation scales concern FP8 matmuls, not the dequantized weights.
    """
    q = raw.get("quantization_config")
    if q is None:
        return None
    q = {k: v for k, v in q.items() if k != "modules_to_not_convert"}  # the converter sees which are FP8
    block = q.pop("weight_block_size", None)
    expected = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if any(q.get(k, v) != v for k, v in expected.items()) or set(q) - set(expected) or not (
            isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(
            f"quantization_config {raw['quantization_config']!r} is not supported; only block-wise FP8 "
            "(quant_method 'fp8', fmt 'e4m3', weight_block_size [out, in]) is"
        )
    return int(block[0]), int(block[1])


def _parse_moe(r: _Reader, family: Family, num_layers: int) -> MoEConfig | None:
    """The experts of a MoE family (None for dense families, whose configs may not use these keys)."""
    if not _TRAITS[family].moe:
        return None
    r.seen.update(_MOE_TRAINING_ONLY)
    if _TRAITS[family].mla:
        return _deepseek_moe(r, num_layers)
    num_experts = _num_experts(r)
    top_k = int(r.require("num_experts_per_tok"))
    if family is Family.MIXTRAL:  # every layer sparse, experts as wide as intermediate_size
        return MoEConfig(num_experts, top_k, int(r.require("intermediate_size")), (True,) * num_layers)
    return MoEConfig(
        num_experts, top_k, int(r.require("moe_intermediate_size")), _qwen_moe_layers(r, num_layers),
        renormalize=bool(r.get("norm_topk_prob", False)),
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF config dict, refusing anything it would get wrong."""
    model_type = raw.get("model_type")
    try:
        family = Family(model_type)
    except ValueError:
        supported = ", ".join(f.value for f in Family)
        raise ConfigError(
            f"unsupported architecture model_type={model_type!r}; supported: {supported}"
        ) from None
    r = _Reader(raw)
    r.seen.add("model_type")
    for key, allowed in _REQUIRED_VALUES.items():
        if r.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{key}={raw[key]!r} is not supported; supported: {allowed}")
    hidden = int(r.require("hidden_size"))
    num_heads = int(r.require("num_attention_heads"))
    num_layers = int(r.require("num_hidden_layers"))
    traits = _TRAITS[family]
    mla = _parse_mla(r, num_heads) if traits.mla else None
    # RoPE covers the whole head, or with latent attention only its rotary part.
    head_dim = mla.rope_dim if mla else int(r.get("head_dim", hidden // num_heads))
    max_pos = int(r.get("max_position_embeddings", 2048))
    attention_bias = bool(r.get("attention_bias", False))
    r.seen.add("quantization_config")
    fp8_block_size(raw)  # validated here, applied by the converter's reader
    if traits.mla:
        # Code pointers of the hub's remote implementation, which dayzero never runs.
        r.seen.add("auto_map")
    config = ModelConfig(
        family=family,
        vocab_size=int(r.require("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(r.require("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(r.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(r.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope=_parse_rope(r, head_dim, max_pos),
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or traits.qkv_bias,
        o_bias=attention_bias,
        qk_norm=traits.qk_norm,
        sliding_windows=_sliding_windows(r, family, num_layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
        moe=_parse_moe(r, family, num_layers),
        attention=AttentionKind.MLA if mla else AttentionKind.GQA,
        mla=mla,
        dsa=_parse_dsa(r) if traits.dsa else None,
        mtp_layers=int(r.get("num_nextn_predict_layers", r.get("num_mtp_layers", 0))) if traits.mla else 0,
    )
    leftover = r.leftover()
    if leftover:
        raise ConfigError(
            f"config.json has keys dayzero does not handle for model_type={model_type!r}: "
            f"{', '.join(leftover)}; support them in dayzero.model.config before converting"
        )
    return config


def load_hf_config(path: str | Path) -> ModelConfig:
    """Parse an HF ``config.json`` file (or the ``config.json`` inside a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}; pass an HF model directory") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    return parse_hf_config(raw)
