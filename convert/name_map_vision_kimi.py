"""Name map of Kimi-K2.5's vision tower and projector (``dayzero.model.vision_kimi_weights``), in
the recipe style of ``dayzero.convert.name_map``.

Three spellings of the same tensors, each a complete layout of the map:

- Moonshot's, as the published Kimi-K2.5 safetensors name them (the main layout):
  ``vision_tower.patch_embed.{proj,pos_emb}``, ``vision_tower.encoder.blocks.{i}.{norm0, norm1,
  wqkv, wo, mlp.fc0, mlp.fc1}``, ``vision_tower.encoder.final_layernorm``,
  ``mm_projector.{pre_norm, proj.0, proj.2}``. The fused ``wqkv`` [3Dv, Dv] holds q, k, v rows one
  after the other, and q's and k's rows of each head pair for MoonViT's interleaved (complex)
  rotary: transformers' loader (``PermuteForRope``) reorders them, per head, into the
  rotate-half pairs its forward and dayzero's use; :func:`dayzero.convert.transforms.llama_cpp_unpermute`
  is that same reordering.
- what transformers' ``save_pretrained`` writes (Moonshot's names, but
  ``vision_tower.encoder.patch_embed.*`` and ``model.mm_projector.pre_norm.*``), which its
  loader reads back.
- transformers' module names (``model.vision_tower.layers.{i}.attn.{q,k,v}_proj`` already in
  rotate-half order, ``model.mm_projector.{pre_norm, in_proj, out_proj}``).

Targets start with ``dst`` (default ``vision/``, as the Qwen tower's map). PyTorch Linear weights
are [out, in]; dayzero keeps the input first.

:func:`kimi_vision_weights_from_state_dict` applies the map to an in-memory state dict (the tests).

:func:`kimi_composite_name_map` is the whole Kimi-K2.5 checkpoint's (``name_map_vision.composite_name_map``
hands a config with a :class:`KimiVisionConfig` here): the DeepSeek-V3 text model in three
spellings, each paired with the tower's spelling the same writer uses:

- Moonshot's published files: ``language_model.model.layers.{i}.``, ``language_model.model.{embed_tokens,
  norm}``, ``language_model.lm_head``; experts per expert;
- ``save_pretrained`` of transformers' ``Kimi_K25ForConditionalGeneration``: the same, but the layers
  written back as ``language_model.model.blocks.{i}.`` (its loader's ``blocks -> layers`` rename,
  meant for the tower, runs in reverse over the text model too, and its loader reads them back);
- transformers' module names: ``model.language_model.layers.{i}.``, ``lm_head``; experts per expert
  or fused (``mlp.experts.gate_up_proj``).
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Mapping

import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert import transforms_linear as TL
from dayzero.convert.name_map import _HF_IGNORED, NameMap, Recipe, _hf_experts, _hf_fused_experts, _hf_recipes
from dayzero.model.config import ModelConfig
from dayzero.convert.name_map_vision import conv_patch, linear_recipe, norm_recipes, weights_from_plan
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from dayzero.model.vision_kimi_weights import KimiVisionWeights, kimi_vision_specs

# Buffers HF derives from the config (non-persistent; a file written while they were is still read).
_DERIVED = re.compile(r"(^|\.)(rotary_emb\.(original_)?inv_freq|pos_emb\.time_position_embeddings)$")


def _flat_grid(x: np.ndarray) -> np.ndarray:
    """The learned position grid [side, side, Dv] -> [side*side, Dv], row-major as HF flattens it."""
    return x.reshape(-1, x.shape[-1])


def _fused_qkv(kc: KimiVisionConfig, src: str, dst: str) -> list[Recipe]:
    """q, k, v [Dv,N,H] and biases [N,H] from Moonshot's ``wqkv`` rows [q | k | v], q and k per
    head from interleaved rotary pairs to rotate-half order."""
    D, N, H = kc.hidden_size, kc.num_heads, kc.head_dim
    heads, bias = partial(T.split_heads_in, heads=N, head_dim=H), partial(T.split_bias, heads=N, head_dim=H)
    r = []
    for i, name in enumerate(("q", "k", "v")):
        part = partial(TL.rows, start=i * D, stop=(i + 1) * D)
        order = (partial(T.llama_cpp_unpermute, heads=N),) if name != "v" else ()
        r += [Recipe(dst + name, src + "wqkv.weight", (3 * D, D), (part, *order, heads)),
              Recipe(f"{dst}{name}_bias", src + "wqkv.bias", (3 * D,), (part, *order, bias))]
    return r


def _split_qkv(kc: KimiVisionConfig, src: str, dst: str) -> list[Recipe]:
    """q, k, v from transformers' separate ``{q,k,v}_proj`` (already in rotate-half order)."""
    D, N, H = kc.hidden_size, kc.num_heads, kc.head_dim
    heads, bias = partial(T.split_heads_in, heads=N, head_dim=H), partial(T.split_bias, heads=N, head_dim=H)
    r = []
    for name in ("q", "k", "v"):
        r += [Recipe(dst + name, f"{src}{name}_proj.weight", (D, D), (heads,)),
              Recipe(f"{dst}{name}_bias", f"{src}{name}_proj.bias", (D,), (bias,))]
    return r


def _block(kc: KimiVisionConfig, src: str, dst: str, moonshot: bool) -> list[Recipe]:
    """One encoder block: Moonshot's names (``norm0``/``norm1``, ``wqkv``, ``wo``, ``mlp.fc0``/``fc1``)
    or transformers' (``norm1``/``norm2``, ``attn.*``, ``mlp.fc1``/``fc2``)."""
    D, N, H, F = kc.hidden_size, kc.num_heads, kc.head_dim, kc.intermediate_size
    norms, fcs, o = (("norm0", "norm1"), ("mlp.fc0", "mlp.fc1"), "wo") if moonshot else \
        (("norm1", "norm2"), ("mlp.fc1", "mlp.fc2"), "attn.proj")
    qkv = _fused_qkv(kc, src, dst + "attn/") if moonshot else _split_qkv(kc, src + "attn.", dst + "attn/")
    return [
        *norm_recipes(src + norms[0], dst + "norm1", D), *norm_recipes(src + norms[1], dst + "norm2", D), *qkv,
        Recipe(dst + "attn/o", f"{src}{o}.weight", (D, D), (partial(T.split_heads_out, heads=N, head_dim=H),)),
        Recipe(dst + "attn/o_bias", f"{src}{o}.bias", (D,)),
        *linear_recipe(src + fcs[0], dst + "mlp/fc1", D, F), *linear_recipe(src + fcs[1], dst + "mlp/fc2", F, D),
    ]


# Per spelling: patch embedding, position grid, blocks, final norm, projector norm, its two Linears.
_SPELLINGS = {
    "moonshot": ("vision_tower.patch_embed.proj", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.", "vision_tower.encoder.final_layernorm", "mm_projector.pre_norm",
                 ("mm_projector.proj.0", "mm_projector.proj.2")),
    "hf_saved": ("vision_tower.encoder.patch_embed.proj", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.", "vision_tower.encoder.final_layernorm", "model.mm_projector.pre_norm",
                 ("mm_projector.proj.0", "mm_projector.proj.2")),
    "hf_modules": ("model.vision_tower.patch_embed.proj", "model.vision_tower.patch_embed.pos_emb.position_embeddings",
                   "model.vision_tower.layers.", "model.vision_tower.final_layernorm", "model.mm_projector.pre_norm",
                   ("model.mm_projector.in_proj", "model.mm_projector.out_proj")),
}


def kimi_vision_recipes(kc: KimiVisionConfig, spelling: str = "moonshot", dst: str = "vision/") -> tuple[Recipe, ...]:
    """One recipe per leaf of ``kimi_vision_specs(kc)`` (paths under ``dst``), reading the HF
    tensors of ``spelling`` (a key of :data:`_SPELLINGS`)."""
    patch, grid, blocks, final, pre_norm, (fc1, fc2) = _SPELLINGS[spelling]
    D, side, U = kc.hidden_size, kc.pos_emb_side, kc.hidden_size * kc.merge_unit
    r = [
        Recipe(dst + "patch", patch + ".weight", (D, kc.in_channels, kc.patch_size, kc.patch_size), (conv_patch,)),
        Recipe(dst + "patch_bias", patch + ".bias", (D,)),
        Recipe(dst + "pos_embed", grid, (side, side, D), (_flat_grid,)),
        *norm_recipes(final, dst + "final_norm", D),
        *norm_recipes(pre_norm, dst + "projector/norm", D),
        *linear_recipe(fc1, dst + "projector/mlp/fc1", U, U),
        *linear_recipe(fc2, dst + "projector/mlp/fc2", U, kc.out_hidden_size),
    ]
    for i in range(kc.depth):
        r += _block(kc, f"{blocks}{i}.", f"{dst}blocks/{i}/", moonshot=spelling != "hf_modules")
    return tuple(r)


def kimi_vision_name_map(kc: KimiVisionConfig, dst: str = "vision/") -> NameMap:
    """The map in each spelling (Moonshot's published one first); only derived buffers are ignored."""
    main, *others = (kimi_vision_recipes(kc, s, dst) for s in _SPELLINGS)
    return NameMap(main, lambda name: bool(_DERIVED.search(name)), tuple(others))


def kimi_vision_weights_from_state_dict(kc: KimiVisionConfig, tensors: Mapping[str, np.ndarray]) -> KimiVisionWeights:
    """The tower's and projector's weights (numpy leaves) from a state dict holding them only, in
    any of the map's spellings: checked by the converter's own :func:`~dayzero.convert.name_map.plan`
    (every tensor used, shapes as the config implies), then every leaf against its spec."""
    return weights_from_plan(kimi_vision_name_map(kc, dst=""), tensors, kimi_vision_specs(kc), "Kimi vision")


# The text model's spellings (prefix of the decoder, word naming its layers, lm_head), each with
# the tower spelling of the same writer and whether its experts may be fused (module docstring).
_TEXT_SPELLINGS = (
    ("language_model.model.", "layers", "language_model.lm_head.weight", "moonshot", False),
    ("language_model.model.", "blocks", "language_model.lm_head.weight", "hf_saved", False),
    ("model.language_model.", "layers", "lm_head.weight", "hf_modules", True),
)
_TEXT_LAYER = re.compile(r"^(?:language_model\.model\.(?:layers|blocks)|model\.language_model\.layers)\.(\d+)\.")


def _text_recipes(c: ModelConfig, experts, prefix: str, layers: str, lm_head: str) -> tuple[Recipe, ...]:
    """The DeepSeek-V3 text model's recipes (``name_map._hf_recipes`` under ``prefix``), its
    decoder layers named ``{prefix}{layers}.{i}.`` and its output matrix ``lm_head``."""
    def rename(name: str) -> str:
        if name == "lm_head.weight":
            return lm_head
        return prefix + layers + name[len(prefix + "layers"):] if name.startswith(prefix + "layers.") else name

    return tuple(dataclasses.replace(r, sources=tuple(rename(n) for n in r.sources))
                 for r in _hf_recipes(c, experts, prefix))


def kimi_composite_name_map(c: ModelConfig) -> NameMap:
    """Kimi-K2.5's whole checkpoint (module docstring): text and tower under their writer's
    spellings, Moonshot's first. Ignored: derived buffers, a tied model's ``lm_head`` copy and the
    multi-token-prediction layers past ``num_layers`` (plain decoding never runs them)."""
    layouts = []
    for prefix, layers, lm_head, tower, may_fuse in _TEXT_SPELLINGS:
        vision = kimi_vision_recipes(c.vision, tower)
        for experts in (_hf_experts, _hf_fused_experts) if may_fuse and c.moe is not None else (_hf_experts,):
            layouts.append(_text_recipes(c, experts, prefix, layers, lm_head) + vision)

    def ignored(name: str) -> bool:
        layer = _TEXT_LAYER.match(name)
        return (bool(_HF_IGNORED.search(name) or _DERIVED.search(name))
                or (c.tie_word_embeddings and name in ("lm_head.weight", "language_model.lm_head.weight"))
                or (layer is not None and c.num_layers <= int(layer.group(1)) < c.num_layers + c.mtp_layers))

    return NameMap(layouts[0], ignored, tuple(layouts[1:]))
