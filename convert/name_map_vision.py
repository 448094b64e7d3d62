"""Name map of the Qwen3-VL / Qwen3.5 vision tower (``dayzero.model.vision_weights``), in the
recipe style of ``dayzero.convert.name_map``: which HF tensors feed which leaf, through which
value transforms (PyTorch Linear weights are [out, in]; dayzero keeps the input first).

HF spells the tower ``model.visual.*`` (transformers 5's in-memory names and ``save_pretrained``
of the composite models, the published Qwen3-VL and Qwen3.5 files) or ``visual.*`` (older
spellings); :func:`vision_name_map` offers both. Its target paths start with ``dst`` (default
``vision/``, where the whole model's tree is expected to hold the tower), so its recipes can be
appended to a text model's map. The fused ``attn.qkv`` [3Dv, Dv] holds q, k, v rows one after the
other, each head-major (HF views its output as [P, 3, N, H]).

:func:`composite_name_map` is the whole multimodal checkpoint's map (``hf_name_map`` hands every
config with a ``vision`` tower here): each spelling of the text model with each spelling of the
tower. The text model of Qwen3.5 is ``dayzero.convert.name_map_linear``'s; Qwen3-VL's is
Qwen3's / Qwen3-MoE's under ``model.language_model.``, its experts fused in one of two layouts
that HF spells alike: the published files' input-major ``gate_up_proj`` [E, D, 2F] (gate columns
first) and ``down_proj`` [E, F, D], which transformers transposes on load, or the in-memory
[E, 2F, D] and [E, D, F] that ``save_pretrained`` writes back. The shapes tell them apart
(``NameMap.layout_for``): the two tensors cannot both be square.

:func:`vision_weights_from_state_dict` applies the same recipes to an in-memory state dict (the
tests, before the converter reads the tower).
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Mapping

import jax
import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert import transforms_linear as TL
from dayzero.convert.errors import ConvertError
from dayzero.convert.name_map import _HF_IGNORED, NameMap, Recipe, _hf_fused_experts, _hf_recipes, plan
from dayzero.model.config import ModelConfig
from dayzero.model.hf_config_vision import VisionConfig
from dayzero.model.vision_weights import VisionWeights, vision_specs
from dayzero.model.weights import is_spec, leaf_path

VISION_PREFIXES = ("model.visual.", "visual.")
# A buffer HF derives from the config; checkpoints written while it was persistent carry it.
_DERIVED = re.compile(r"(^|\.)rotary_pos_emb\.inv_freq$")


def conv_patch(x: np.ndarray) -> np.ndarray:
    """HF's patch Conv3d weight [Dv, C, T, P, P] (kernel = stride) -> the matmul [C*T*P*P, Dv]
    over a flattened patch (the processor flattens each patch in the same C, T, P, P order)."""
    return x.reshape(x.shape[0], -1).T


def _qkv(vc: VisionConfig, src: str, dst: str) -> list[Recipe]:
    """q, k, v [Dv,N,H] and their biases [N,H] from the fused ``qkv`` rows [q | k | v]."""
    D, N, H = vc.hidden_size, vc.num_heads, vc.head_dim
    r = []
    for i, name in enumerate(("q", "k", "v")):
        part = partial(TL.rows, start=i * D, stop=(i + 1) * D)
        heads, bias = partial(T.split_heads_in, heads=N, head_dim=H), partial(T.split_bias, heads=N, head_dim=H)
        r += [Recipe(dst + name, src + "qkv.weight", (3 * D, D), (part, heads)),
              Recipe(f"{dst}{name}_bias", src + "qkv.bias", (3 * D,), (part, bias))]
    return r


def linear_recipe(src: str, dst: str, n_in: int, n_out: int) -> list[Recipe]:
    """A biased nn.Linear ``{src}.weight`` [out, in] -> ``{dst}`` [in, out] and ``{dst}_bias``."""
    return [Recipe(dst, src + ".weight", (n_out, n_in), (T.transpose,)), Recipe(dst + "_bias", src + ".bias", (n_out,))]


def norm_recipes(src: str, dst: str, n: int) -> list[Recipe]:
    """A LayerNorm ``{src}.weight`` / ``.bias`` -> ``{dst}`` / ``{dst}_bias``."""
    return [Recipe(dst, src + ".weight", (n,)), Recipe(dst + "_bias", src + ".bias", (n,))]


def _block(vc: VisionConfig, src: str, dst: str) -> list[Recipe]:
    D, N, H, F = vc.hidden_size, vc.num_heads, vc.head_dim, vc.intermediate_size
    return [
        *norm_recipes(src + "norm1", dst + "norm1", D), *norm_recipes(src + "norm2", dst + "norm2", D),
        *_qkv(vc, src + "attn.", dst + "attn/"),
        Recipe(dst + "attn/o", src + "attn.proj.weight", (D, D), (partial(T.split_heads_out, heads=N, head_dim=H),)),
        Recipe(dst + "attn/o_bias", src + "attn.proj.bias", (D,)),
        *linear_recipe(src + "mlp.linear_fc1", dst + "mlp/fc1", D, F),
        *linear_recipe(src + "mlp.linear_fc2", dst + "mlp/fc2", F, D),
    ]


def _merger(vc: VisionConfig, src: str, dst: str, post_shuffle: bool) -> list[Recipe]:
    U = vc.hidden_size * vc.merge_unit
    return [*norm_recipes(src + "norm", dst + "norm", U if post_shuffle else vc.hidden_size),
            *linear_recipe(src + "linear_fc1", dst + "mlp/fc1", U, U),
            *linear_recipe(src + "linear_fc2", dst + "mlp/fc2", U, vc.out_hidden_size)]


def vision_recipes(vc: VisionConfig, src: str = "model.visual.", dst: str = "vision/") -> tuple[Recipe, ...]:
    """One recipe per leaf of ``vision_specs(vc)`` (paths under ``dst``), reading HF tensors under ``src``."""
    D = vc.hidden_size
    r = [
        Recipe(dst + "patch", src + "patch_embed.proj.weight",
               (D, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size), (conv_patch,)),
        Recipe(dst + "patch_bias", src + "patch_embed.proj.bias", (D,)),
        Recipe(dst + "pos_embed", src + "pos_embed.weight", (vc.num_position_embeddings, D)),
        *_merger(vc, src + "merger.", dst + "merger/", post_shuffle=False),
    ]
    for i in range(vc.depth):
        r += _block(vc, f"{src}blocks.{i}.", f"{dst}blocks/{i}/")
    for j in range(len(vc.deepstack_indexes)):
        r += _merger(vc, f"{src}deepstack_merger_list.{j}.", f"{dst}deepstack/{j}/", post_shuffle=True)
    return tuple(r)


def vision_name_map(vc: VisionConfig, dst: str = "vision/") -> NameMap:
    """The tower's map in each HF spelling (``model.visual.`` first); only the derived rotary
    buffer is ignored."""
    main, *others = (vision_recipes(vc, p, dst) for p in VISION_PREFIXES)
    return NameMap(main, lambda name: bool(_DERIVED.search(name)), tuple(others))


def vision_weights_from_state_dict(vc: VisionConfig, tensors: Mapping[str, np.ndarray]) -> VisionWeights:
    """The tower's weights (numpy leaves) from a state dict of the tower only, spelled with one of
    :data:`VISION_PREFIXES` or bare (``Qwen3VLVisionModel.state_dict()``): checked by the
    converter's own :func:`~dayzero.convert.name_map.plan` (every tensor used, shapes as the
    config implies), then every leaf checked against its spec."""
    # The spelling is the one its patch embedding has (so that a problem is named in it).
    prefix = next((p for p in VISION_PREFIXES if p + "patch_embed.proj.weight" in tensors), "")
    name_map = NameMap(vision_recipes(vc, prefix, ""), vision_name_map(vc).is_ignored)
    return weights_from_plan(name_map, tensors, vision_specs(vc), "vision")


def weights_from_plan(name_map: NameMap, tensors: Mapping[str, np.ndarray], specs: Any, what: str) -> Any:
    """The weight tree ``specs`` declares, filled from ``tensors`` through ``name_map`` as the
    converter's :func:`~dayzero.convert.name_map.plan` lays it out (every tensor used, shapes as
    the config implies), each leaf then checked against its spec (``what`` names the tower)."""
    recipes = plan(name_map, tensors, lambda name: tuple(np.shape(tensors[name])), f"the {what} state dict")
    leaves = {r.target: r.apply(np.asarray(tensors[r.source])) for r in recipes}
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    for path, spec in flat:
        if leaves[leaf_path(path)].shape != spec.shape:
            raise ConvertError(f"{what} leaf {leaf_path(path)} came out {leaves[leaf_path(path)].shape}, its spec says "
                               f"{spec.shape}")
    return jax.tree.unflatten(treedef, [np.ascontiguousarray(leaves[leaf_path(p)]) for p, _ in flat])


def _input_major_experts(c: ModelConfig, src: str, dst: str) -> list[Recipe]:
    """Qwen3-VL-MoE's published experts (module docstring): router ``mlp.gate.weight`` [E,D],
    ``mlp.experts.gate_up_proj`` [E,D,2F] (gate columns, then up) and ``down_proj`` [E,F,D],
    both already input-major."""
    D, E, F = c.hidden_size, c.moe.num_experts, c.moe.intermediate_size
    gate_up = src + "mlp.experts.gate_up_proj"
    half = lambda h: (T.transpose_experts, partial(T.split_gate_up, half=h))  # noqa: E731
    return [
        Recipe(dst + "mlp/router", src + "mlp.gate.weight", (E, D), (T.transpose,)),
        Recipe(dst + "mlp/gate", gate_up, (E, D, 2 * F), half(0)),
        Recipe(dst + "mlp/up", gate_up, (E, D, 2 * F), half(1)),
        Recipe(dst + "mlp/down", src + "mlp.experts.down_proj", (E, F, D)),
    ]


def _qwen_vl_text(c: ModelConfig) -> NameMap:
    """Qwen3-VL's text model under ``model.language_model.`` (``lm_head`` at the top level):
    Qwen3's layers, the experts in either fused layout (published first)."""
    prefix = "model.language_model."
    experts = (_input_major_experts, _hf_fused_experts) if c.moe is not None else (_input_major_experts,)
    main, *others = (_hf_recipes(c, e, prefix) for e in experts)
    return NameMap(main, lambda name: bool(_HF_IGNORED.search(name))
                   or (c.tie_word_embeddings and name == "lm_head.weight"), tuple(others))


def composite_name_map(c: ModelConfig) -> NameMap:
    """A multimodal checkpoint's map (module docstring): every text spelling with every spelling
    of the tower, the published ones first; a tensor either part ignores is ignored. Kimi-K2.5's
    is ``dayzero.convert.name_map_vision_kimi``'s."""
    from dayzero.convert.name_map_vision_kimi import KimiVisionConfig, kimi_composite_name_map

    if isinstance(c.vision, KimiVisionConfig):
        return kimi_composite_name_map(c)
    if c.linear is not None:
        from dayzero.convert.name_map_linear import linear_name_map

        text = linear_name_map(c)
    else:
        text = _qwen_vl_text(c)
    vision = vision_name_map(c.vision)
    layouts = [t + v for t in (text.recipes, *text.alternatives) for v in (vision.recipes, *vision.alternatives)]
    return NameMap(layouts[0], lambda name: text.is_ignored(name) or vision.is_ignored(name), tuple(layouts[1:]))
