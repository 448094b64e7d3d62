"""Model architecture configuration: families, RoPE, MoE, MLA and DSA settings, ``ModelConfig``.

Built from an HF ``config.json`` by :mod:`dayzero.model.hf_config` (strict parsing), and
serialised in dayzero's own form by :meth:`ModelConfig.to_json` / :meth:`ModelConfig.from_json`.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported for real in from_json only: hf_config_vision imports this module
    from dayzero.model.hf_config_vision import VisionConfig


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
    # GLM-5: DeepSeek-V3.2's layers with an interleaved-RoPE indexer whose picks "shared" layers
    # reuse from the last "full" one (DSAConfig.shared)
    GLM_MOE_DSA = "glm_moe_dsa"
    # GLM-4.5/4.6/4.7: GQA with q/k/v biases, optional q/k norms and partial RoPE, DeepSeek-V3 routing
    GLM4_MOE = "glm4_moe"
    # MiniMax-M2/M2.1: GQA with q/k RMSNorm over all heads together, partial RoPE, sigmoid routing
    # with a selection bias in every layer (no groups, no shared experts)
    MINIMAX_M2 = "minimax_m2"
    # gpt-oss: GQA with q/k/v/o biases and attention sinks, alternating sliding-window and full
    # layers, YaRN; softmax routing with a router bias, experts with biases and a clamped SwiGLU
    GPT_OSS = "gpt_oss"
    # DeepSeek-V4: one shared key/value head per token over a sliding window plus compressed
    # entries (CompressedConfig), hyper-connection residual streams (HyperConfig), sqrt-softplus
    # routing with hash-routed first layers
    DEEPSEEK_V4 = "deepseek_v4"
    # Qwen3-Next: Gated DeltaNet layers (LinearAttnConfig) between gated full-attention layers
    # (an output gate from q_proj, zero-centred norms, partial RoPE), MoE with a gated shared expert
    QWEN3_NEXT = "qwen3_next"
    # Qwen3.5 (the text model of qwen3_5 / qwen3_5_moe): Qwen3-Next's layers, unfused projections
    QWEN3_5 = "qwen3_5"
    QWEN3_5_MOE = "qwen3_5_moe"
    # Kimi-Linear: Kimi Delta Attention layers between latent-attention layers without RoPE,
    # DeepSeek-V3 routing
    KIMI_LINEAR = "kimi_linear"
    # Qwen1.5-MoE / Qwen2-57B-A14B: Qwen2's attention (q/k/v biases), softmax top-k routing and a
    # shared expert behind a sigmoid gate in each sparse layer
    QWEN2_MOE = "qwen2_moe"


class AttentionKind(enum.Enum):
    """Which attention block a model's layers use (``dayzero.model.transformer.attention_block``
    or ``dayzero.model.mla.mla_block``)."""

    GQA = "gqa"  # grouped-query attention over per-head keys/values (MHA and MQA included)
    MLA = "mla"  # multi-head latent attention: one compressed latent per token (DeepSeek-V3)
    # DeepSeek-V4: a sliding window of one key=value head plus compressed entries per layer kind
    # (``dayzero.model.compressed``)
    COMPRESSED = "compressed"


class LinearKind(enum.Enum):
    """Which linear-attention recurrence a hybrid model's linear layers run (``dayzero.model.linear_attn``)."""

    GATED_DELTA = "gated_delta"  # Gated DeltaNet (Qwen3-Next, Qwen3.5): one decay per value head
    KIMI_DELTA = "kimi_delta"  # Kimi Delta Attention (Kimi-Linear): one decay per head and key channel


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
    # Fraction of each head that is rotated (HF partial_rotary_factor): its first
    # int(head_dim * factor) dims, as half-split pairs; the rest passes through unrotated.
    partial_rotary_factor: float = 1.0
    # Multi-axis RoPE (Qwen3-VL, Qwen3.5: HF mrope_section, mrope_interleaved): how many of the
    # R/2 frequencies turn with the temporal, height and width position of a token; interleaved:
    # frequency j turns with height if j % 3 == 1 and j < 3 * sections[1], with width if j % 3 == 2
    # and j < 3 * sections[2], else with time. Empty: one position axis. A text token has the
    # same position on all three axes, where this is plain RoPE.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))  # a JSON list reads back
        section = self.mrope_section
        if section and (len(section) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                 for s in section)):
            raise ConfigError(f"mrope_section={list(section)} must be 3 non-negative integers (time, height, width)")
        if self.mrope_interleaved and not section:
            raise ConfigError("mrope_interleaved=True needs an mrope_section")

    def rotary_dim(self, head_dim: int) -> int:
        """R: how many leading dims of a head of ``head_dim`` are rotated (HF's int(H * factor))."""
        return int(head_dim * self.partial_rotary_factor)


class RouterScore(enum.Enum):
    """How a router turns its logits into per-expert scores (HF ``scoring_func`` names)."""

    SOFTMAX = "softmax"  # over all E experts (Mixtral, Qwen3-MoE)
    SIGMOID = "sigmoid"  # each expert on its own (DeepSeek-V3)
    SQRTSOFTPLUS = "sqrtsoftplus"  # sqrt(softplus(logit)), each expert on its own (DeepSeek-V3)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sparse Mixture-of-Experts feed-forward blocks: E SwiGLU experts, C of them per token.

    Routing (``dayzero.model.moe.route``): scores from the router logits; each token's C experts
    are those with the largest score (+ the learned bias, when ``score_bias``), taken only from
    its ``groups_per_token`` best expert groups when ``num_groups > 1``; their weights are the
    scores without bias, renormalised to sum 1 if ``renormalize``, times ``routed_scaling``.
    Mixtral and Qwen3-MoE use softmax scores and the defaults below; DeepSeek-V3 uses sigmoid
    scores, a bias, groups, scaling and shared experts.

    gpt-oss: a ``router_bias`` added to the logits before anything else (so, unlike
    ``score_bias``, it moves both the choice and the weights), softmax scores renormalised over
    the C chosen (HF's softmax over the top-k logits, the same numbers), experts with biases
    (``expert_bias``) and the clamped SwiGLU of ``dayzero.model.moe.gated``: gate clamped above
    and up on both sides at ``swiglu_limit``, gate * sigmoid(``swiglu_alpha`` * gate) *
    (up + ``swiglu_up_shift``). The defaults are the plain SwiGLU silu(gate) * up.
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
    # The shared SwiGLU's width when it is not a multiple of F (Qwen3-Next's
    # shared_expert_intermediate_size; needs shared_experts >= 1). 0: shared_experts * F.
    shared_intermediate_size: int = 0
    # The shared expert's output scaled per token by sigmoid(x . w) (Qwen3-Next's shared_expert_gate).
    shared_gate: bool = False
    router_bias: bool = False  # a learned [E] bias added to the router logits (gpt-oss)
    expert_bias: bool = False  # biases on each expert's gate/up [E,F] and down [E,D] (gpt-oss)
    swiglu_limit: float | None = None  # clamp of the experts' gate (above) and up (both sides)
    swiglu_alpha: float = 1.0  # gate * sigmoid(alpha * gate); 1 is silu
    swiglu_up_shift: float = 0.0  # the up projection enters as (up + shift); gpt-oss adds 1
    # Per decoder layer: True where the experts come from a fixed token-id -> experts table
    # (``MoEWeights.tid2eid`` [V,C], DeepSeek-V4's hash-routed first layers) instead of the top-C
    # scores; the weights are still the chosen experts' scores. Empty: no hash-routed layer.
    hash_layers: tuple[bool, ...] = ()

    @property
    def shared_width(self) -> int:
        """Width of the shared experts' one SwiGLU (0: none)."""
        if not self.shared_experts:
            return 0
        return self.shared_intermediate_size or self.shared_experts * self.intermediate_size

    def __post_init__(self):
        hashed = tuple(bool(h) for h in self.hash_layers)
        object.__setattr__(self, "hash_layers", hashed if any(hashed) else ())
        if self.hash_layers and len(self.hash_layers) != len(self.layers):
            raise ConfigError(f"{len(self.hash_layers)} hash-routing flags given for {len(self.layers)} layers")
        if (self.shared_gate or self.shared_intermediate_size) and not self.shared_experts:
            raise ConfigError("a shared expert gate or width needs shared_experts >= 1")
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ConfigError(f"swiglu_limit={self.swiglu_limit} must be positive (or null for no clamp)")
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
    # Kimi-Linear: the "rope" parts of queries and keys are never rotated (latent attention
    # without positions; the linear layers carry order).
    nope: bool = False


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2): per layer, a lightning indexer scores every
    visible token for each query and latent attention reads only the ``topk`` best.

    Indexer (``dayzero.model.dsa``): I = ``heads`` queries of width ``head_dim`` from the q LoRA
    latent, one key of ``head_dim`` per token (LayerNorm'd, cached beside the latent row), and a
    per-head weight from the hidden state; the first ``rope_dim`` dims of queries and keys are
    rotated with half-split pairs (not the interleaved pairs of the main attention), or with
    interleaved pairs when ``rope_interleave`` (GLM-5).

    GLM-5 (HF ``indexer_types``): a layer marked in ``shared`` runs no indexer and attends to the
    tokens the last unmarked layer before it picked (empty: every layer runs its own).
    """

    topk: int  # index_topk: tokens each query attends to
    heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    rope_interleave: bool = False  # the indexer's rotary pairs adjacent (GLM-5), not half-split
    shared: tuple[bool, ...] = ()  # per layer: reuses the previous full layer's picks

    def __post_init__(self):
        # A JSON list reads back as the tuple; no shared layer at all is the plain () of DeepSeek-V3.2.
        shared = tuple(bool(s) for s in self.shared)
        object.__setattr__(self, "shared", shared if any(shared) else ())

    def runs_indexer(self, i: int) -> bool:
        """Whether layer ``i`` picks its own tokens (False: it reuses the last full layer's picks)."""
        return not self.shared or not self.shared[i]


class CompressKind(enum.Enum):
    """DeepSeek-V4's attention layer kinds (HF ``layer_types`` names)."""

    SLIDING = "sliding_attention"  # the sliding window only
    CSA = "compressed_sparse_attention"  # + entries of every csa_ratio tokens, an indexer picks top-k
    HCA = "heavily_compressed_attention"  # + entries of every hca_ratio tokens, all visible ones read


@dataclasses.dataclass(frozen=True)
class CompressedConfig:
    """DeepSeek-V4 attention (``dayzero.model.compressed``), letters as in NOTES.md's V4 study.

    Every layer: queries from a q LoRA (``q_lora_rank``) then an unweighted RMS per head, one
    key=value head of ``head_dim`` per token (RMSNorm'd), RoPE on each head's trailing R dims
    with interleaved pairs, learned sinks, and a sliding ``window`` of past tokens (the token
    itself included). CSA/HCA layers add compressed entries: one per ``ratio`` tokens, a
    per-channel softmax-gated sum of the window's projected rows (CSA: over 2 * ratio rows, the
    previous window's and its own), RMSNorm'd and rotated at the window's first position; HCA
    reads every visible entry, CSA the ``index_topk`` an indexer of ``index_heads`` x
    ``index_head_dim`` picks. CSA/HCA layers rotate with ``compress_rope``, sliding ones with the
    model's ``rope``. The output [N*H] goes through ``o_groups`` block-diagonal projections to
    ``o_lora_rank`` each, then one projection to D.
    """

    kinds: tuple[CompressKind, ...]  # per decoder layer
    window: int  # W: keys each query sees in the sliding part, itself included
    compress_rope: RopeConfig
    q_lora_rank: int  # Q
    o_groups: int  # g
    o_lora_rank: int  # d_g
    index_topk: int
    index_heads: int  # I
    index_head_dim: int  # J
    csa_ratio: int = 4
    hca_ratio: int = 128

    def __post_init__(self):
        object.__setattr__(self, "kinds", tuple(CompressKind(k) for k in self.kinds))
        for name in ("window", "q_lora_rank", "o_groups", "o_lora_rank", "index_topk", "index_heads",
                     "index_head_dim", "csa_ratio", "hca_ratio"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")

    def ratio_of(self, kind: CompressKind) -> int | None:
        """Tokens per compressed entry in a layer of ``kind`` (None: a sliding-only layer)."""
        return {CompressKind.SLIDING: None, CompressKind.CSA: self.csa_ratio, CompressKind.HCA: self.hca_ratio}[kind]

    def ratio(self, i: int) -> int | None:
        """Tokens per compressed entry in layer ``i`` (None: a sliding-only layer)."""
        return self.ratio_of(self.kinds[i])


@dataclasses.dataclass(frozen=True)
class HyperConfig:
    """Manifold-constrained hyper-connections (DeepSeek-V4, ``dayzero.model.hyper``): the residual
    is ``mult`` streams, mixed around each block by a Sinkhorn-normalised matrix
    (``sinkhorn_iters`` normalisations, ``eps`` in every division and added to the gates)."""

    mult: int  # n, HF hc_mult
    sinkhorn_iters: int
    eps: float

    def __post_init__(self):
        if self.mult < 1 or self.sinkhorn_iters < 1:
            raise ConfigError(f"hc_mult={self.mult} and hc_sinkhorn_iters={self.sinkhorn_iters} must be at least 1")


@dataclasses.dataclass(frozen=True)
class LinearAttnConfig:
    """The linear-attention layers of a hybrid model (``dayzero.model.linear_attn``).

    A linear layer projects queries and keys to ``num_k_heads`` heads of ``k_head_dim`` and values
    to ``num_v_heads`` heads of ``v_head_dim`` (each query/key head serves num_v_heads /
    num_k_heads consecutive value heads), runs each through a depthwise causal convolution of
    ``conv_kernel`` taps and SiLU, L2-normalises queries and keys and runs the gated delta rule:
    per value head a state S [k_head_dim, v_head_dim], decayed by exp(g) (one g per head for
    GATED_DELTA, one per key channel for KIMI_DELTA), corrected towards v by beta * k, read by q.
    Its cache is that state (float32) and the convolutions' last conv_kernel - 1 inputs: fixed
    size, whatever the context. ``chunk``: tokens per chunk of the chunked (prefill) form.
    """

    kind: LinearKind
    layers: tuple[bool, ...]  # per decoder layer: True for a linear-attention layer
    num_k_heads: int  # Hk
    num_v_heads: int  # Hv
    k_head_dim: int  # dk
    v_head_dim: int  # dv
    conv_kernel: int = 4
    chunk: int = 64

    def __post_init__(self):
        object.__setattr__(self, "kind", LinearKind(self.kind))
        object.__setattr__(self, "layers", tuple(bool(x) for x in self.layers))
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.conv_kernel < 2:
            raise ConfigError(f"linear_conv_kernel_dim={self.conv_kernel} must be at least 2")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"linear_num_value_heads={self.num_v_heads} must be a multiple of "
                              f"linear_num_key_heads={self.num_k_heads}")
        if self.kind is LinearKind.KIMI_DELTA and (self.num_k_heads != self.num_v_heads
                                                   or self.k_head_dim != self.v_head_dim):
            raise ConfigError("Kimi Delta Attention has one head count and one head dim for queries, keys and values")

    def is_linear(self, i: int) -> bool:
        """Whether decoder layer ``i`` is a linear-attention layer."""
        return self.layers[i]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The decoder layers with (full) attention, in order: the layers the KV cache holds."""
        return tuple(i for i, lin in enumerate(self.layers) if not lin)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers, in order: the layers the state cache holds."""
        return tuple(i for i, lin in enumerate(self.layers) if lin)


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
    # The q (k) norm takes one RMS over all N (K) heads of a token, its weight [N,H] ([K,H]),
    # instead of one per head with a shared [H] weight (MiniMax-M2's "per_layer" q/k norm).
    qk_norm_all_heads: bool = False
    # Per layer: None for full causal attention, else the sliding window length.
    sliding_windows: tuple[int | None, ...] = ()
    # A learned logit per query head in each attention softmax's denominator, a key whose value
    # is zero (gpt-oss's sinks, weights ``AttentionWeights.sinks`` [N] in float32).
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    attention: AttentionKind = AttentionKind.GQA
    mla: MLAConfig | None = None  # set iff attention is MLA; head_dim is then its rope_dim
    dsa: DSAConfig | None = None  # sparse attention over the latent rows (needs mla)
    # Multi-token-prediction modules stored after the last layer (DeepSeek-V3's
    # num_nextn_predict_layers): plain decoding never runs them; the converter skips their tensors
    # (DeepSeek-V4's it keeps, DeepSeek-V3's too where the source has them: ``mtp_kept``).
    mtp_layers: int = 0
    # DeepSeek-V3's MTP modules are in the weights (``Weights.mtp``, ``dayzero.model.mtp``): the
    # converter sets it when the source has their tensors; ``--speculative mtp`` drafts with them.
    mtp_kept: bool = False
    compressed: CompressedConfig | None = None  # set iff attention is COMPRESSED (DeepSeek-V4)
    hyper: HyperConfig | None = None  # hyper-connection residual streams (None: one plain residual)
    # Linear-attention hybrids (Qwen3-Next, Qwen3.5, Kimi-Linear): which layers are linear and
    # their shapes; the other layers attend as ``attention`` says.
    linear: LinearAttnConfig | None = None
    # Added to every RMSNorm weight of the decoder (layer norms, q/k norms, final norm) in fp32:
    # Qwen3-Next stores its norms zero-centred and scales by (1 + w).
    norm_weight_offset: float = 0.0
    # The query projection also gives a gate per head and dim: the attention output is scaled by
    # sigmoid(gate) before ``o`` (Qwen3-Next's full-attention layers).
    attn_output_gate: bool = False
    # The vision tower in front of the text model (Qwen3-VL, Qwen3.5 multimodal files; Kimi-K2.5's
    # KimiVisionConfig), with the image placeholder token ids; None: a text-only model.
    vision: VisionConfig | None = None

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
        if self.dsa is not None and self.dsa.shared and (len(self.dsa.shared) != self.num_layers or self.dsa.shared[0]):
            raise ConfigError(
                f"{len(self.dsa.shared)} indexer layer types given for {self.num_layers} layers, first "
                f"{'shared' if self.dsa.shared[0] else 'full'}: give one per layer, the first 'full'"
            )
        if (self.compressed is not None) != (self.attention is AttentionKind.COMPRESSED):
            raise ConfigError(f"attention={self.attention.value} needs compressed settings iff it is COMPRESSED")
        if self.compressed is not None and (len(self.compressed.kinds) != self.num_layers or self.num_kv_heads != 1):
            raise ConfigError(
                f"compressed attention needs one layer kind per layer ({len(self.compressed.kinds)} given for "
                f"{self.num_layers}) and one key/value head (num_key_value_heads={self.num_kv_heads})"
            )
        if self.attention_sinks and self.attention is AttentionKind.MLA:
            raise ConfigError("attention_sinks=True is not supported with latent attention")
        if self.qk_norm_all_heads and not self.qk_norm:
            raise ConfigError("qk_norm_all_heads=True needs qk_norm=True (it says how the q/k norm is taken)")
        rotary = self.rope.rotary_dim(self.head_dim)
        if not 0 < self.rope.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
            raise ConfigError(
                f"partial_rotary_factor={self.rope.partial_rotary_factor} rotates {rotary} of head_dim="
                f"{self.head_dim} dims; it must be in (0, 1] and rotate an even number >= 2 of them"
            )
        if self.linear is not None and (len(self.linear.layers) != self.num_layers or all(self.linear.layers)
                                        or self.compressed is not None):
            raise ConfigError(
                f"{len(self.linear.layers)} linear-layer flags given for {self.num_layers} layers; give one per "
                "layer with at least one full-attention layer (and no compressed attention)")
        if self.moe is not None and len(self.moe.layers) != self.num_layers:
            raise ConfigError(f"{len(self.moe.layers)} MoE layer flags given for {self.num_layers} layers")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ConfigError(f"the vision tower's out_hidden_size={self.vision.out_hidden_size} differs from "
                              f"hidden_size={self.hidden_size}: its embeddings could not replace token embeddings")

    def is_linear_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` is a linear-attention layer of a hybrid model."""
        return self.linear is not None and self.linear.layers[i]

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
        if self.linear is not None:
            d["linear"]["kind"] = self.linear.kind.value
        if self.compressed is not None:
            d["compressed"]["kinds"] = [k.value for k in self.compressed.kinds]
            d["compressed"]["compress_rope"]["type"] = self.compressed.compress_rope.type.value
        if self.vision is not None:
            d["vision"] = self.vision.to_json()
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
            moe = MoEConfig(**{**moe, "score": RouterScore(moe["score"]), "layers": tuple(moe["layers"]),
                               "hash_layers": tuple(moe.get("hash_layers", ()))})
        compressed = d.pop("compressed", None)
        if compressed is not None:
            crope = dict(compressed["compress_rope"], type=RopeType(compressed["compress_rope"]["type"]))
            compressed = CompressedConfig(**{**compressed, "kinds": tuple(compressed["kinds"]),
                                             "compress_rope": RopeConfig(**crope)})
        hyper = d.pop("hyper", None)
        linear = d.pop("linear", None)
        vision = d.pop("vision", None)
        if vision is not None:  # Qwen's tower or Kimi-K2.5's, as its "kind" says
            from dayzero.model.hf_config_vision_kimi import vision_config_from_json

            vision = vision_config_from_json(vision)
        return cls(
            family=Family(d.pop("family")),
            rope=RopeConfig(**rope),
            sliding_windows=tuple(d.pop("sliding_windows")),
            eos_token_ids=tuple(d.pop("eos_token_ids")),
            moe=moe,
            attention=attention,
            mla=None if mla is None else MLAConfig(**mla),
            dsa=None if dsa is None else DSAConfig(**dsa),
            compressed=compressed,
            hyper=None if hyper is None else HyperConfig(**hyper),
            linear=None if linear is None else LinearAttnConfig(**{**linear, "layers": tuple(linear["layers"])}),
            vision=vision,
            **d,
        )
