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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a dense decoder-only transformer (dimension letters as in DESIGN.md)."""

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

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` reads back exactly."""
        d = dataclasses.asdict(self)
        d["family"] = self.family.value
        d["rope"]["type"] = self.rope.type.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of :meth:`to_json` (dayzero's own parsed form, not an HF config)."""
        d = dict(d)
        rope = dict(d.pop("rope"))
        rope["type"] = RopeType(rope["type"])
        return cls(
            family=Family(d.pop("family")),
            rope=RopeConfig(**rope),
            sliding_windows=tuple(d.pop("sliding_windows")),
            eos_token_ids=tuple(d.pop("eos_token_ids")),
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
    window = r.get("sliding_window")
    layer_types = r.get("layer_types")
    use_sliding = r.get("use_sliding_window", family is Family.MISTRAL)
    max_window_layers = r.get("max_window_layers", num_layers)
    if layer_types is None:
        layer_types = [
            "sliding_attention" if use_sliding and window and i >= (0 if family is Family.MISTRAL else max_window_layers)
            else "full_attention"
            for i in range(num_layers)
        ]
    windows = []
    for kind in layer_types:
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise ConfigError("layer_types has 'sliding_attention' but sliding_window is not set")
            windows.append(int(window))
        else:
            raise ConfigError(f"unsupported layer type '{kind}' in layer_types")
    return tuple(windows)


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
    head_dim = int(r.get("head_dim", hidden // num_heads))
    max_pos = int(r.get("max_position_embeddings", 2048))
    attention_bias = bool(r.get("attention_bias", False))
    qkv_bias = attention_bias or family is Family.QWEN2
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
        qkv_bias=qkv_bias,
        o_bias=attention_bias,
        qk_norm=family is Family.QWEN3,
        sliding_windows=_sliding_windows(r, family, num_layers),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_token_ids(raw.get("eos_token_id")),
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
