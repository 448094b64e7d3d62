"""The vision tower's configuration (Qwen3-VL / Qwen3.5 family), parsed strictly from the
``vision_config`` object of an HF ``config.json``.

Four composite model_types carry the same vision transformer (``Qwen3VLVisionModel`` and its
copies in transformers' ``qwen3_vl_moe``, ``qwen3_5`` and ``qwen3_5_moe``): patch embedding, a
learned position table resampled to each image's grid, 2D rotary positions, full-attention
blocks over each frame's patches, a 2x2 patch merger. The only difference is DeepStack: Qwen3-VL
(``qwen3_vl`` / ``qwen3_vl_moe``) merges the hidden states after the ``deepstack_visual_indexes``
blocks too and the text model adds them to its first layers' hidden states; Qwen3.5's vision
model has no DeepStack mergers and never reads that key (its published configs still carry
``"deepstack_visual_indexes": []``).

As ``dayzero.model.hf_config`` does for the text model: every key is used, ignored for a stated
reason, or at HF's default; anything else is one error listing the keys.

The whole composite files are parsed here too (:func:`parse_composite`): the top level, the text
model under ``text_config`` (Qwen3.5's by ``dayzero.model.hf_config_linear``; Qwen3-VL's,
:func:`parse_qwen_vl_config`, as Qwen3 / Qwen3-MoE at HF's Qwen3-VL defaults) and the tower.
Both text models rotate with multi-axis RoPE (:func:`split_mrope`), which HF always interleaves.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from functools import partial
from typing import Any, Callable

from dayzero.model.config import ConfigError, Family, ModelConfig
from dayzero.model.hf_config import _Reader, _token_ids as _eos_ids, fold_aliases, parse_hf_config


class VisionAct(enum.Enum):
    """The vision blocks' MLP activation (HF ``hidden_act``)."""

    GELU_TANH = "gelu_pytorch_tanh"  # the tanh approximation (published Qwen3-VL / Qwen3.5)
    GELU = "gelu"  # exact (erf) GELU, as the patch mergers always use


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Architecture of the Qwen3-VL / Qwen3.5 vision tower (letters: Dv ``hidden_size``, F
    ``intermediate_size``, N ``num_heads``, H = Dv / N, M ``spatial_merge_size``).

    A patch is ``in_channels`` x ``temporal_patch_size`` x ``patch_size`` x ``patch_size`` pixels;
    M x M neighbouring patches merge into one embedding of ``out_hidden_size`` (the text model's
    hidden size). ``deepstack_indexes``: the blocks (0-based) after which a DeepStack merger
    also runs (empty for Qwen3.5).

    The token ids (the composite config's top level, HF's defaults where it leaves them out) are
    what the text side needs: ``image_token_id`` (``video_token_id``) marks each placeholder an
    image's (video's) merged embedding replaces, between ``vision_start_token_id`` and
    ``vision_end_token_id``. None: not known (a tower parsed from its vision_config alone).
    """

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: VisionAct = VisionAct.GELU_TANH
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    def __post_init__(self):
        problems = []
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        elif self.head_dim % 4:
            # Half of each head rotates by the row, half by the column, each in rotate-half pairs.
            problems.append(f"head_dim={self.head_dim} (hidden_size / num_heads) is not a multiple of 4")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            problems.append(f"num_position_embeddings={self.num_position_embeddings} is not a square (the learned "
                            "positions are a square grid)")
        bad = [i for i in self.deepstack_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_indexes)) != len(self.deepstack_indexes):
            problems.append(f"deepstack_visual_indexes={list(self.deepstack_indexes)} must be distinct blocks "
                            f"in [0, {self.depth})")
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "in_channels",
                     "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be a positive integer")
        if problems:
            raise ConfigError("vision_config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """H: the width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The length of one flattened patch (C * T * P * P, the processor's pixel_values row)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """How many patches merge into one output embedding (M * M)."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """The side of the learned square position grid."""
        return math.isqrt(self.num_position_embeddings)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` reads back exactly."""
        d = dataclasses.asdict(self)
        d["hidden_act"] = self.hidden_act.value
        d["deepstack_indexes"] = list(self.deepstack_indexes)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "VisionConfig":
        """Inverse of :meth:`to_json` (dayzero's own parsed form, not an HF vision_config)."""
        d = dict(d)
        d["hidden_act"] = VisionAct(d["hidden_act"])
        d["deepstack_indexes"] = tuple(d["deepstack_indexes"])
        return cls(**d)


# The composite model_types whose vision tower this is; the value says whether it has DeepStack.
# A vision_config's own model_type is "<composite>_vision", or the composite's name in files
# written before HF renamed it (HF rewrites those on load).
VISION_MODEL_TYPES = {"qwen3_vl": True, "qwen3_vl_moe": True, "qwen3_5": False, "qwen3_5_moe": False}

# HF's defaults (the four vision config classes agree) for keys a file may leave out.
_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
                 in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
                 num_position_embeddings=2304)
_QWEN3_VL_DEEPSTACK = (8, 16, 24)  # Qwen3VLVisionConfig's default
# The composite configs' defaults for the placeholder token ids (image, video, vision start, end).
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_QWEN3_VL_TOKENS, _QWEN3_5_TOKENS = (151655, 151656, 151652, 151653), (248056, 248057, 248053, 248054)
_TOKEN_DEFAULTS = {"qwen3_vl": _QWEN3_VL_TOKENS, "qwen3_vl_moe": _QWEN3_VL_TOKENS, "qwen3_5": _QWEN3_5_TOKENS,
                   "qwen3_5_moe": _QWEN3_5_TOKENS}

# Keys of a vision_config that do not change what the tower computes, besides those
# ``dayzero.model.hf_config`` ignores everywhere (provenance, runtime switches, id2label...).
_VISION_IGNORED = {
    "initializer_range": "weight init, training only",
}

_ALIASES = (("num_attention_heads", "num_heads"), ("num_hidden_layers", "depth"))  # HF's attribute_map


def _int(r: _Reader, key: str) -> int:
    value = r.get(key, _DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"vision_config {key}={value!r} must be an integer")
    return value


def _rope_theta(r: _Reader) -> float:
    """The axial rotary base: ``rope_parameters`` (or the older ``rope_scaling``) with rope_type
    "axial" (or "default", which HF turns into "axial"), else a top-level ``rope_theta``, else 10000."""
    top = r.get("rope_theta", 10000.0)
    params = r.get("rope_parameters") or r.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"vision_config rope_parameters={params!r} must be an object")
    unknown = sorted(set(params) - {"rope_type", "type", "rope_theta"})
    kind = params.get("rope_type", params.get("type", "default"))
    if unknown or kind not in ("axial", "default"):
        raise ConfigError(f"vision_config rope_parameters={params!r}: only the axial rope with a rope_theta is "
                          "supported (the Qwen3-VL vision tower's)")
    theta = params.get("rope_theta", top)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"vision_config rope_theta={theta!r} must be a positive number")
    return float(theta)


def _deepstack(r: _Reader, model_type: str) -> tuple[int, ...]:
    value = r.get("deepstack_visual_indexes", _QWEN3_VL_DEEPSTACK if VISION_MODEL_TYPES[model_type] else ())
    if not isinstance(value, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ConfigError(f"vision_config deepstack_visual_indexes={value!r} must be a list of block indexes")
    # Qwen3.5's vision model builds no DeepStack mergers and never reads the key (module docstring).
    return tuple(value) if VISION_MODEL_TYPES[model_type] else ()


def parse_vision_config(raw: dict[str, Any], model_type: str, text_hidden_size: int | None = None) -> VisionConfig:
    """The :class:`VisionConfig` of the ``vision_config`` object ``raw`` of a ``model_type``
    composite config (one of :data:`VISION_MODEL_TYPES`). ``text_hidden_size``, when given, must
    equal ``out_hidden_size`` (the merged embeddings replace the text model's token embeddings).
    Raises :class:`ConfigError` naming every key it cannot handle."""
    if model_type not in VISION_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} has no Qwen vision tower dayzero runs; supported: "
                          f"{', '.join(VISION_MODEL_TYPES)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"vision_config={raw!r} must be an object")
    own = raw.get("model_type")
    if own is not None and own not in (model_type, f"{model_type}_vision"):
        raise ConfigError(f"vision_config model_type={own!r} does not belong in a {model_type!r} config (expected "
                          f"{model_type + '_vision'!r})")
    r = _Reader(fold_aliases(raw, _ALIASES))
    r.seen.update({"model_type", *_VISION_IGNORED})
    act = r.get("hidden_act", _DEFAULTS["hidden_act"])
    if act not in {a.value for a in VisionAct}:
        raise ConfigError(f"vision_config hidden_act={act!r} is not supported; dayzero runs "
                          f"{', '.join(a.value for a in VisionAct)}")
    if r.get("is_encoder_decoder", False):  # PretrainedConfig plumbing, false in every vision_config
        raise ConfigError("vision_config is_encoder_decoder=true does not describe the Qwen vision tower")
    fields = dict(
        depth=_int(r, "depth"), hidden_size=_int(r, "hidden_size"), num_heads=_int(r, "num_heads"),
        intermediate_size=_int(r, "intermediate_size"), out_hidden_size=_int(r, "out_hidden_size"),
        hidden_act=VisionAct(act), in_channels=_int(r, "in_channels"), patch_size=_int(r, "patch_size"),
        temporal_patch_size=_int(r, "temporal_patch_size"), spatial_merge_size=_int(r, "spatial_merge_size"),
        num_position_embeddings=_int(r, "num_position_embeddings"), deepstack_indexes=_deepstack(r, model_type),
        rope_theta=_rope_theta(r),
    )
    leftover = r.leftover()
    if leftover:  # before the values' checks: an unknown key may be why they look wrong
        raise ConfigError(f"vision_config has keys dayzero does not handle for model_type={model_type!r}: "
                          f"{', '.join(leftover)}; support them in dayzero.model.hf_config_vision first")
    config = VisionConfig(**fields)
    if text_hidden_size is not None and text_hidden_size != config.out_hidden_size:
        raise ConfigError(f"vision_config out_hidden_size={config.out_hidden_size} differs from the text model's "
                          f"hidden_size={text_hidden_size}; the image embeddings could not replace token embeddings")
    return config


def _token_ids(raw: dict[str, Any], model_type: str) -> dict[str, int]:
    """The placeholder token ids of a composite config's top level (HF's defaults for those left out)."""
    ids = {}
    for key, default in zip(_TOKEN_KEYS, _TOKEN_DEFAULTS[model_type]):
        value = raw.get(key)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}={value!r} must be a token id (a non-negative integer)")
        ids[key] = value
    return ids


def vision_config_from_hf(raw: dict[str, Any], text_hidden_size: int | None = None) -> VisionConfig | None:
    """The vision tower of a whole HF ``config.json`` dict: None when it has no ``vision_config``
    (a text-only file), else :func:`parse_vision_config` of it under the file's model_type, with
    the placeholder token ids of the file's top level."""
    if raw.get("vision_config") is None:
        return None
    config = parse_vision_config(raw["vision_config"], raw.get("model_type"), text_hidden_size)
    return dataclasses.replace(config, **_token_ids(raw, raw["model_type"]))


# ---- multi-axis RoPE ----------------------------------------------------------------------------

_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
# HF's mrope_section where the RoPE parameters leave it out (the text models' rotary embeddings).
QWEN3_VL_MROPE, QWEN3_5_MROPE = (24, 20, 20), (11, 11, 10)


def split_mrope(raw: dict[str, Any], default_section: tuple[int, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``raw`` with the M-RoPE keys taken out of ``rope_parameters`` / ``rope_scaling``, the
    :class:`~dayzero.model.config.RopeConfig` fields they give). HF's Qwen3-VL and Qwen3.5 text
    models always interleave the axes and never read ``mrope_interleaved``: only true is accepted."""
    out, found = dict(raw), {}
    for key in ("rope_scaling", "rope_parameters"):  # as hf_config reads them: rope_parameters wins
        params = raw.get(key)
        if isinstance(params, dict):
            found.update({k: params[k] for k in _MROPE_KEYS if k in params})
            out[key] = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
    section = found.get("mrope_section")
    section = default_section if section is None else section
    if not isinstance(section, (list, tuple)):
        raise ConfigError(f"rope_parameters' mrope_section={section!r} must be a list of 3 integers")
    if found.get("mrope_interleaved", True) is not True:
        raise ConfigError(f"mrope_interleaved={found['mrope_interleaved']!r} is not supported: HF's "
                          f"{raw.get('model_type')} always interleaves the M-RoPE axes; set it to true or remove it")
    return out, {"mrope_section": tuple(section), "mrope_interleaved": True}


# ---- composite files: a text model and its vision tower -----------------------------------------

_COMPOSITE_IGNORED = {
    # vLLM's switch to serve the text model alone; HF never reads it (it builds the tower whatever
    # it says), and neither does dayzero: the tower is converted with the rest.
    "language_model_only": "a runtime switch of vLLM, never read by HF",
}


def parse_composite(raw: dict[str, Any], text_type: str, parse_text: Callable[[dict], ModelConfig],
                    tower: Callable[[dict, int], Any] = vision_config_from_hf, handled: tuple[str, ...] = (),
                    tie_default: bool = False) -> ModelConfig:
    """A composite ``config.json`` (model_type one of :data:`VISION_MODEL_TYPES`, or Kimi-K2.5's
    through ``dayzero.model.hf_config_vision_kimi``): ``text_config`` (model_type ``text_type``, or
    left out) parsed by ``parse_text``, the tower by ``tower(raw, text hidden size)`` (default
    :func:`vision_config_from_hf`), which reads ``vision_config`` and the top-level keys named in
    ``handled``. At the top level: tie_word_embeddings (the one HF's ``*ForConditionalGeneration``
    ties by, ``tie_default`` where left out; text_config's is never read, and HF's own to_dict()
    leaves it at its default when only the top level's is set), bos/eos ids (winning over
    text_config's), the placeholder ids, a block-FP8 quantization_config, and keys that repeat
    text_config's with the same value (fine-tuning tools copy hidden_size up); anything else is
    refused."""
    from dayzero.model.hf_config_linear import _check_quantization  # it imports this module

    model_type = raw["model_type"]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json of model_type={model_type!r} has no text_config object; it is not a "
                          f"{model_type} checkpoint's config")
    if text.get("model_type", text_type) != text_type:
        raise ConfigError(f"text_config model_type={text['model_type']!r} does not belong in a {model_type!r} "
                          f"config (expected {text_type!r})")
    if not isinstance(raw.get("vision_config", {}), dict):
        raise ConfigError(f"vision_config={raw['vision_config']!r} must be an object")
    r = _Reader(raw)
    r.seen.update({"model_type", "text_config", "vision_config", "tie_word_embeddings", *_COMPOSITE_IGNORED, *handled})
    _check_quantization(r)
    r.seen.update(k for k in r.leftover() if k in text and text[k] == raw[k])
    if r.leftover():
        raise ConfigError(f"config.json has keys dayzero does not handle for model_type={model_type!r}: "
                          f"{', '.join(r.leftover())}; support them in dayzero.model.hf_config_vision before "
                          "converting")
    try:
        config = parse_text({**text, "model_type": text_type})
    except ConfigError as e:
        raise ConfigError(f"text_config: {e}") from None
    ids = {}
    if raw.get("bos_token_id") is not None:
        ids["bos_token_id"] = raw["bos_token_id"]
    if raw.get("eos_token_id") is not None:
        ids["eos_token_ids"] = _eos_ids(raw["eos_token_id"])
    tie = raw.get("tie_word_embeddings")
    return dataclasses.replace(config, tie_word_embeddings=bool(tie_default if tie is None else tie),
                               vision=tower(raw, config.hidden_size), **ids)


# ---- Qwen3-VL's text models ----------------------------------------------------------------------

# Composite model_type -> its text_config's model_type; the text model_type -> the family it runs as.
QWEN_VL_TEXT = {"qwen3_vl": "qwen3_vl_text", "qwen3_vl_moe": "qwen3_vl_moe_text"}
_QWEN_VL_FAMILY = {"qwen3_vl_text": Family.QWEN3, "qwen3_vl_moe_text": Family.QWEN3_MOE}
# HF's field defaults (Qwen3VLTextConfig, Qwen3VLMoeTextConfig; rope_theta: their default_theta).
_QWEN_VL_DEFAULTS = {
    "qwen3_vl_text": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=128000,
                          rms_norm_eps=1e-6),
    "qwen3_vl_moe_text": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128000,
                              rms_norm_eps=1e-6, decoder_sparse_step=1, moe_intermediate_size=1408,
                              num_experts_per_tok=4, num_experts=60),
}
_QWEN_VL_THETA = 500000.0
# HF's Qwen3-VL text configs set sliding_window to None whatever the file says: no layer slides.
_QWEN_VL_DROPPED = ("sliding_window", "max_window_layers")


def parse_qwen_vl_config(raw: dict[str, Any]) -> ModelConfig:
    """A ``qwen3_vl`` / ``qwen3_vl_moe`` config.json: :func:`parse_composite` with the text model
    of :func:`_parse_qwen_vl_text`."""
    text_type = QWEN_VL_TEXT[raw["model_type"]]
    return parse_composite(raw, text_type, partial(_parse_qwen_vl_text, text_type=text_type))


def _parse_qwen_vl_text(text: dict[str, Any], text_type: str) -> ModelConfig:
    """Qwen3-VL's text model: Qwen3 (dense) or Qwen3-MoE as ``dayzero.model.hf_config`` parses
    them, at HF's Qwen3-VL defaults, with interleaved M-RoPE. Where HF's Qwen3-VL classes compute
    otherwise than Qwen3's: no layer slides a window (sliding_window is read and dropped,
    use_sliding_window accepted only false), the MoE router always renormalises its top-k weights
    (norm_topk_prob accepted only true)."""
    family = _QWEN_VL_FAMILY[text_type]
    text, mrope = split_mrope(fold_aliases(text, (("num_local_experts", "num_experts"),)), QWEN3_VL_MROPE)
    fixed = {"use_sliding_window": False, "norm_topk_prob": True} if family is Family.QWEN3_MOE else \
        {"use_sliding_window": False}
    for key, value in fixed.items():
        if text.get(key) not in (None, value):
            raise ConfigError(f"{key}={text[key]!r} is not supported for {text_type}: HF's implementation computes "
                              f"{key}={value} whatever the file says; set it so or remove it")
    filled = {k: v for k, v in _QWEN_VL_DEFAULTS[text_type].items() if text.get(k) is None}
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    if text.get("rope_theta") is None and params.get("rope_theta") is None:
        filled["rope_theta"] = _QWEN_VL_THETA
    kept = {k: v for k, v in text.items() if k not in _QWEN_VL_DROPPED}
    config = parse_hf_config({**kept, **filled, **fixed, "model_type": family.value})
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, **mrope))
