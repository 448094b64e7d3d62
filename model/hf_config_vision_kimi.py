"""Kimi-K2.5's vision tower and projector configuration (HF ``kimi_k25``), parsed strictly.

The tower is MoonViT as Kimi-K2.5 extends it: a Conv2d patch embedding, a learned square position
grid resampled bicubically to each image's grid plus a sinusoidal per-frame term (zero for a
single image), 2D rotary positions, pre-norm blocks attending over each image (all its frames
together), a final LayerNorm, then a mean over frames and the projector: LayerNorm per patch,
``kh x kw`` neighbouring patches side by side, Linear -> GELU -> Linear to the text model's width.

Two spellings of the same settings exist, and both are read:

- transformers' (``Kimi_K25Config.to_dict()``): ``vision_config`` with ``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``pos_emb_height`` /
  ``_width`` / ``_time``, ``hidden_act``, ``rope_parameters``; the projector's
  ``projection_hidden_size`` and ``projection_layer_norm_eps`` at the top level.
- Moonshot's, as the published Kimi-K2.5 config.json writes it: ``vt_hidden_size``,
  ``vt_num_hidden_layers``, ``vt_num_attention_heads``, ``vt_intermediate_size``,
  ``init_pos_emb_height`` / ``_width`` / ``_time``, and the projector inside ``vision_config``
  (``mm_hidden_size``, ``projector_ln_eps``, ``projector_hidden_act``, ``mm_projector_type``,
  ``text_hidden_size``) with the choices of its remote code (``pos_emb_type``,
  ``video_attn_type``, ``merge_type``), each accepted only at the value HF implements.

As ``dayzero.model.hf_config_vision`` does: every key of ``vision_config`` is used, ignored for a
stated reason, or at HF's default; anything else is one error listing the keys.

The whole file (:func:`parse_kimi_k25_config`) is ``hf_config_vision.parse_composite``'s: the
text model under ``text_config`` is DeepSeek-V3's (Moonshot's files say ``kimi_k2``, which HF
reads as ``deepseek_v3``), the tower is this module's, and the top level adds the image
placeholder id (Moonshot's ``media_placeholder_token_id`` or HF's ``image_token_id``, 163605
``<|media_pad|>``), which lands in ``KimiVisionConfig.image_token_id`` where the engine reads the
Qwen towers' ``VisionConfig.image_token_id``. HF's Kimi_K25Config ties the embeddings unless the
file says otherwise. The text model rotates with plain RoPE: images take one position per
placeholder token, as text does (no M-RoPE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dayzero.model.config import ConfigError, ModelConfig
from dayzero.model.hf_config import _Reader, fold_aliases, parse_hf_config
from dayzero.model.hf_config_vision import VisionAct, VisionConfig, parse_composite

MODEL_TYPE = "kimi_k25"


@dataclasses.dataclass(frozen=True)
class KimiVisionConfig:
    """Architecture of Kimi-K2.5's vision tower and projector (letters: Dv ``hidden_size``, F
    ``intermediate_size``, N ``num_heads``, H = Dv / N, kh x kw ``merge_kernel``, K = kh*kw,
    Dt ``out_hidden_size``: the text model's width).

    A patch is 3 x ``patch_size`` x ``patch_size`` pixels; the learned position grid is
    ``pos_emb_side`` square; the sinusoidal time table covers up to ``pos_emb_time`` frames;
    ``projector_eps`` is the projector LayerNorm's epsilon (the tower's norms use 1e-5, fixed).
    ``image_token_id``: the placeholder each merged embedding replaces (None: not known, a tower
    parsed from its vision_config alone).
    """

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: VisionAct = VisionAct.GELU_TANH
    patch_size: int = 14
    pos_emb_side: int = 64
    pos_emb_time: int = 4
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    projector_eps: float = 1e-5
    image_token_id: int | None = None

    def __post_init__(self):
        problems = []
        token = self.image_token_id
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
            problems.append(f"image_token_id={token!r} must be a token id (a non-negative integer)")
        for name in ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "patch_size",
                     "pos_emb_side", "pos_emb_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        if not (len(self.merge_kernel) == 2 and all(isinstance(k, int) and k >= 1 for k in self.merge_kernel)):
            problems.append(f"merge_kernel_size={list(self.merge_kernel)} must be two positive integers")
        if not problems and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_heads}")
        elif not problems and self.head_dim % 4:
            # Half of each head's rotary pairs turn by the column, half by the row.
            problems.append(f"head_dim={self.head_dim} (hidden_size / num_attention_heads) is not a multiple of 4")
        if not self.rope_theta > 0 or not self.projector_eps > 0:
            problems.append(f"rope_theta={self.rope_theta} and projector_ln_eps={self.projector_eps} must be positive")
        if problems:
            raise ConfigError("kimi_k25 vision_config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        """H: the width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def in_channels(self) -> int:
        """Colour channels of a patch (HF's Conv2d takes 3)."""
        return 3

    @property
    def patch_dim(self) -> int:
        """The length of one flattened patch (C * P * P; the processor's [C, P, P] patch, flattened)."""
        return self.in_channels * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """K: how many patches of a frame merge into one output embedding (kh * kw)."""
        return self.merge_kernel[0] * self.merge_kernel[1]

    @property
    def num_position_embeddings(self) -> int:
        """The learned position grid's size (side * side)."""
        return self.pos_emb_side ** 2

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict that :meth:`from_json` reads back exactly; its ``kind`` tells
        it from the Qwen towers' (:func:`vision_config_from_json`)."""
        d = dataclasses.asdict(self)
        d["hidden_act"] = self.hidden_act.value
        d["merge_kernel"] = list(self.merge_kernel)
        return {"kind": MODEL_TYPE, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "KimiVisionConfig":
        """Inverse of :meth:`to_json` (dayzero's own parsed form, not an HF vision_config)."""
        d = dict(d)
        d.pop("kind", None)
        d["hidden_act"] = VisionAct(d["hidden_act"])
        d["merge_kernel"] = tuple(d["merge_kernel"])
        return cls(**d)


def vision_config_from_json(d: dict[str, Any]):
    """The tower of a converted model's config (``ModelConfig.to_json``'s ``vision``): Kimi-K2.5's
    where its ``kind`` says so, else the Qwen towers' ``VisionConfig``."""
    if d.get("kind") == MODEL_TYPE:
        return KimiVisionConfig.from_json(d)
    return VisionConfig.from_json(d)


# HF's Kimi_K25VisionConfig defaults (Moonshot's KimiK25VisionConfig has the same values).
_DEFAULTS = dict(num_hidden_layers=27, hidden_size=1152, num_attention_heads=16, intermediate_size=4304,
                 patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4)

# Moonshot's spelling -> transformers' (the same settings; both present must agree).
_ALIASES = (("vt_hidden_size", "hidden_size"), ("vt_num_hidden_layers", "num_hidden_layers"),
            ("vt_num_attention_heads", "num_attention_heads"), ("vt_intermediate_size", "intermediate_size"),
            ("init_pos_emb_height", "pos_emb_height"), ("init_pos_emb_width", "pos_emb_width"),
            ("init_pos_emb_time", "pos_emb_time"))

# Moonshot's switches of its remote code, each at the one value transformers' kimi_k25 implements.
_REQUIRED = {
    "pos_emb_type": "divided_fixed",  # learned 2D grid + fixed sinusoidal time table
    "video_attn_type": "spatial_temporal",  # one attention block over all frames of a clip
    "merge_type": "sd2_tpool",  # mean over frames, then kh x kw spatial groups
    "mm_projector_type": "patchmerger",  # LayerNorm -> Linear -> GELU -> Linear
    "projector_hidden_act": "gelu",  # the projector's exact (erf) GELU
}

_IGNORED = {"initializer_range": "weight init, training only"}


def _int(r: _Reader, key: str) -> int:
    value = r.get(key, _DEFAULTS[key])
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"kimi_k25 vision_config {key}={value!r} must be an integer")
    return value


def _rope_theta(r: _Reader) -> float:
    """The axial rotary base: ``rope_parameters`` of rope_type "axial" (or "default", which HF
    turns into "axial"), else a top-level ``rope_theta``, else MoonViT's 10000."""
    params = r.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"kimi_k25 vision_config rope_parameters={params!r} must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if set(params) - {"rope_type", "type", "rope_theta"} or kind not in ("axial", "default"):
        raise ConfigError(f"kimi_k25 vision_config rope_parameters={params!r}: only the axial rope with a "
                          "rope_theta is supported (MoonViT's 2D rope)")
    theta = params.get("rope_theta", r.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"kimi_k25 vision_config rope_theta={theta!r} must be a positive number")
    return float(theta)


def _merge_kernel(r: _Reader) -> tuple[int, int]:
    value = r.get("merge_kernel_size", (2, 2))
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"kimi_k25 vision_config merge_kernel_size={value!r} must be [kh, kw]")
    return tuple(value)


def _square_side(r: _Reader) -> int:
    height, width = _int(r, "pos_emb_height"), _int(r, "pos_emb_width")
    if height != width:  # HF resamples the flattened table with one side for both axes
        raise ConfigError(f"kimi_k25 vision_config pos_emb_height={height} and pos_emb_width={width} differ; "
                          "the learned position grid must be square")
    return height


def _one_of(**spellings: Any) -> Any:
    """The one value of a setting given under several names (None: not given); all given must agree."""
    given = {k: v for k, v in spellings.items() if v is not None}
    if len({repr(v) for v in given.values()}) > 1:
        raise ConfigError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} disagree; they name one setting, "
                          "keep one")
    return next(iter(given.values()), None)


def parse_kimi_vision_config(raw: dict[str, Any], projector: dict[str, Any] | None = None,
                             text_hidden_size: int | None = None) -> KimiVisionConfig:
    """The :class:`KimiVisionConfig` of a kimi_k25 ``vision_config`` object ``raw``, with the
    projector settings transformers keeps at the file's top level (``projector``:
    ``projection_hidden_size``, ``projection_layer_norm_eps``) and the text model's hidden size
    (``text_hidden_size``; Moonshot's files also say it as ``text_hidden_size``). Raises
    :class:`ConfigError` naming every key it cannot handle."""
    if not isinstance(raw, dict):
        raise ConfigError(f"kimi_k25 vision_config={raw!r} must be an object")
    if raw.get("model_type") not in (None, "", "kimi_k25_vision", MODEL_TYPE):
        raise ConfigError(f"vision_config model_type={raw['model_type']!r} does not belong in a kimi_k25 config "
                          "(expected 'kimi_k25_vision')")
    r = _Reader(fold_aliases(raw, _ALIASES))
    r.seen.update({"model_type", *_IGNORED})
    for key, value in _REQUIRED.items():
        if r.get(key, value) != value:
            raise ConfigError(f"kimi_k25 vision_config {key}={raw[key]!r} is not supported; dayzero runs {key}="
                              f"{value!r} (what transformers' kimi_k25 computes)")
    if r.get("is_encoder_decoder", False):  # PretrainedConfig plumbing, false in every vision_config
        raise ConfigError("kimi_k25 vision_config is_encoder_decoder=true does not describe the vision tower")
    projector = projector or {}
    hidden = _int(r, "hidden_size")
    # The projector's LayerNorm runs over each patch of the tower's output, so its width is the tower's.
    mm_hidden = _one_of(mm_hidden_size=r.get("mm_hidden_size"),
                        projection_hidden_size=projector.get("projection_hidden_size"))
    if mm_hidden not in (None, hidden):
        raise ConfigError(f"the projector's width (projection_hidden_size / mm_hidden_size={mm_hidden}) differs from "
                          f"the vision tower's hidden_size={hidden}; HF's projector normalises the tower's output")
    eps = _one_of(projector_ln_eps=r.get("projector_ln_eps"),
                  projection_layer_norm_eps=projector.get("projection_layer_norm_eps"))
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        raise ConfigError(f"kimi_k25 projector_ln_eps / projection_layer_norm_eps={eps!r} must be a number")
    out = _one_of(text_hidden_size=r.get("text_hidden_size"), text_config_hidden_size=text_hidden_size)
    if out is None:
        raise ConfigError("kimi_k25 vision_config: the text model's hidden size is unknown (no text_hidden_size and "
                          "no text_config); pass text_hidden_size")
    act = r.get("hidden_act", VisionAct.GELU_TANH.value)
    if act not in {a.value for a in VisionAct}:
        raise ConfigError(f"kimi_k25 vision_config hidden_act={act!r} is not supported; dayzero runs "
                          f"{', '.join(a.value for a in VisionAct)}")
    fields = dict(
        depth=_int(r, "num_hidden_layers"), hidden_size=hidden, num_heads=_int(r, "num_attention_heads"),
        intermediate_size=_int(r, "intermediate_size"), out_hidden_size=out, hidden_act=VisionAct(act),
        patch_size=_int(r, "patch_size"), pos_emb_side=_square_side(r), pos_emb_time=_int(r, "pos_emb_time"), merge_kernel=_merge_kernel(r),
        rope_theta=_rope_theta(r), projector_eps=float(1e-5 if eps is None else eps),
    )
    leftover = r.leftover()
    if leftover:
        raise ConfigError(f"kimi_k25 vision_config has keys dayzero does not handle: {', '.join(leftover)}; support "
                          "them in dayzero.model.hf_config_vision_kimi first")
    return KimiVisionConfig(**fields)


def kimi_vision_config_from_hf(raw: dict[str, Any], text_hidden_size: int | None = None) -> KimiVisionConfig | None:
    """The vision tower of a whole kimi_k25 ``config.json`` dict: None when it has no
    ``vision_config`` (a text-only file), else :func:`parse_kimi_vision_config` of it with the
    top-level projector keys and the text model's hidden size (``text_hidden_size``, default
    ``text_config.hidden_size``). The placeholder id is the whole-model parser's (:func:`_tower`)."""
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"model_type={raw.get('model_type')!r} is not {MODEL_TYPE!r}; this parser reads Kimi-K2.5's "
                          "vision tower only")
    if raw.get("vision_config") is None:
        return None
    projector = {k: raw[k] for k in ("projection_hidden_size", "projection_layer_norm_eps") if k in raw}
    if text_hidden_size is None:
        text_hidden_size = (raw.get("text_config") or {}).get("hidden_size")
    return parse_kimi_vision_config(raw["vision_config"], projector, text_hidden_size)


# ---- the whole kimi_k25 config.json -------------------------------------------------------------

IMAGE_TOKEN_ID = 163605  # <|media_pad|>: HF's Kimi_K25Config default, the published media_placeholder_token_id
TEXT_TYPES = ("deepseek_v3", "kimi_k2")  # HF renames Moonshot's kimi_k2 text_config to deepseek_v3 on load

# Top-level keys of Moonshot's file that do not change what the model computes from token ids and pixels.
_TOP_IGNORED = {
    "use_unified_vision_chunk": "vLLM's switch to take images and video chunks as one modality; HF never reads it",
    "video_placeholder": "the prompt text of a video for Moonshot's processor; dayzero takes images only",
    "ignore_index": "the label the training loss skips",
}
# Top-level keys the tower's parse reads (transformers' projector keys, the placeholder id in both spellings).
_TOP_READ = ("projection_hidden_size", "projection_layer_norm_eps", "media_placeholder_token_id", "image_token_id")


def _image_token_id(raw: dict[str, Any]) -> int:
    """The image placeholder id of a kimi_k25 file's top level: Moonshot's
    ``media_placeholder_token_id`` or HF's ``image_token_id`` (both given must agree), else 163605."""
    token = _one_of(media_placeholder_token_id=raw.get("media_placeholder_token_id"),
                    image_token_id=raw.get("image_token_id"))
    token = IMAGE_TOKEN_ID if token is None else token
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ConfigError(f"kimi_k25 media_placeholder_token_id / image_token_id={token!r} must be a token id "
                          "(a non-negative integer)")
    return token


def _tower(raw: dict[str, Any], text_hidden_size: int) -> KimiVisionConfig:
    """The tower of a whole file with its image placeholder id; a file without ``vision_config``
    gets HF's default tower, as ``Kimi_K25Config`` builds it (the checkpoint then holds its weights)."""
    config = kimi_vision_config_from_hf({**raw, "vision_config": raw.get("vision_config") or {}}, text_hidden_size)
    return dataclasses.replace(config, image_token_id=_image_token_id(raw))


def parse_kimi_k25_config(raw: dict[str, Any]) -> ModelConfig:
    """A ``kimi_k25`` config.json (HF's ``Kimi_K25Config`` or Moonshot's file) as one
    :class:`ModelConfig`: the DeepSeek-V3 text model of ``text_config`` with this module's tower
    as ``vision`` (module docstring). Raises :class:`ConfigError` naming every key it cannot handle."""
    text = raw.get("text_config")
    if isinstance(text, dict) and text.get("model_type") not in (None, *TEXT_TYPES):
        raise ConfigError(f"text_config model_type={text['model_type']!r} does not belong in a kimi_k25 config "
                          f"(expected one of {', '.join(TEXT_TYPES)})")
    if isinstance(text, dict):
        raw = {**raw, "text_config": {**text, "model_type": "deepseek_v3"}}
    return parse_composite(raw, "deepseek_v3", parse_hf_config, tower=_tower, handled=(*_TOP_READ, *_TOP_IGNORED),
                           tie_default=True)
