"""Name maps: which source tensor feeds which leaf of the weight tree, and through which transforms.

A map is a list of :class:`Recipe`, one per target leaf (the leaf paths of
``dayzero.model.weights.named_leaves(abstract_weights(config))``, e.g. ``layers/3/attn/q``),
plus a predicate for source tensors that are deliberately not used. :func:`plan` checks a
source against a map before any data is read: every target leaf has exactly one existing source
tensor of the expected shape, and every source tensor is used or explicitly ignored.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Callable, Iterable, Sequence

import numpy as np

from dayzero.convert import transforms as T
from dayzero.convert.errors import ConvertError
from dayzero.model.config import ModelConfig
from dayzero.model.weights import abstract_weights, named_leaves

Transform = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one target leaf is made: from ``source`` (of ``source_shape``) via ``steps`` in order."""

    target: str
    source: str
    source_shape: tuple[int, ...]
    steps: tuple[Transform, ...] = (T.identity,)

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Run the value transforms on a source tensor that already passed the shape check."""
        for step in self.steps:
            x = step(x)
        return x


@dataclasses.dataclass(frozen=True)
class NameMap:
    """The recipes for every target leaf plus the rule for deliberately unused source tensors."""

    recipes: tuple[Recipe, ...]
    is_ignored: Callable[[str], bool]


def group_of(target: str) -> str:
    """Checkpoint group of a leaf: ``layer_003`` for ``layers/3/...``, else ``globals``."""
    parts = target.split("/")
    return f"layer_{int(parts[1]):03d}" if parts[0] == "layers" else "globals"


def key_in_group(target: str) -> tuple[str, ...]:
    """The leaf's key path inside its group (``("attn", "q")`` for ``layers/3/attn/q``)."""
    parts = tuple(target.split("/"))
    return parts[2:] if parts[0] == "layers" else parts


# --- Hugging Face (llama / mistral / qwen2 / qwen3) -------------------------------------------

_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a derived buffer old checkpoints saved


def _hf_layer(c: ModelConfig, i: int) -> list[Recipe]:
    D, F, N, K, H = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    src, dst = f"model.layers.{i}.", f"layers/{i}/"
    heads_in = lambda n: (partial(T.split_heads_in, heads=n, head_dim=H),)  # noqa: E731
    r = [
        Recipe(dst + "attn_norm", src + "input_layernorm.weight", (D,)),
        Recipe(dst + "attn/q", src + "self_attn.q_proj.weight", (N * H, D), heads_in(N)),
        Recipe(dst + "attn/k", src + "self_attn.k_proj.weight", (K * H, D), heads_in(K)),
        Recipe(dst + "attn/v", src + "self_attn.v_proj.weight", (K * H, D), heads_in(K)),
        Recipe(dst + "attn/o", src + "self_attn.o_proj.weight", (D, N * H),
               (partial(T.split_heads_out, heads=N, head_dim=H),)),
        Recipe(dst + "mlp_norm", src + "post_attention_layernorm.weight", (D,)),
        Recipe(dst + "mlp/gate", src + "mlp.gate_proj.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/up", src + "mlp.up_proj.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/down", src + "mlp.down_proj.weight", (D, F), (T.transpose,)),
    ]
    if c.qkv_bias:
        for name, n in (("q", N), ("k", K), ("v", K)):
            r.append(Recipe(dst + f"attn/{name}_bias", src + f"self_attn.{name}_proj.bias", (n * H,),
                            (partial(T.split_bias, heads=n, head_dim=H),)))
    if c.o_bias:
        r.append(Recipe(dst + "attn/o_bias", src + "self_attn.o_proj.bias", (D,)))
    if c.qk_norm:
        r.append(Recipe(dst + "attn/q_norm", src + "self_attn.q_norm.weight", (H,)))
        r.append(Recipe(dst + "attn/k_norm", src + "self_attn.k_norm.weight", (H,)))
    return r


def hf_name_map(c: ModelConfig) -> NameMap:
    """Map for HF ``*ForCausalLM`` state dicts of the llama, mistral, qwen2 and qwen3 families."""
    D, V = c.hidden_size, c.vocab_size
    recipes = [Recipe("embed", "model.embed_tokens.weight", (V, D))]
    for i in range(c.num_layers):
        recipes += _hf_layer(c, i)
    recipes.append(Recipe("final_norm", "model.norm.weight", (D,)))
    if not c.tie_word_embeddings:
        recipes.append(Recipe("lm_head", "lm_head.weight", (V, D), (T.transpose,)))

    def ignored(name: str) -> bool:
        # A tied model may still carry a copy of the embedding as lm_head.weight: it is not read.
        return bool(_HF_IGNORED.search(name)) or (c.tie_word_embeddings and name == "lm_head.weight")

    return NameMap(tuple(recipes), ignored)


# --- GGUF (llama.cpp's "llama" architecture) ----------------------------------------------------


def _gguf_layer(c: ModelConfig, i: int) -> list[Recipe]:
    D, F, N, K, H = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    src, dst = f"blk.{i}.", f"layers/{i}/"
    return [
        Recipe(dst + "attn_norm", src + "attn_norm.weight", (D,)),
        Recipe(dst + "attn/q", src + "attn_q.weight", (N * H, D),
               (partial(T.llama_cpp_unpermute, heads=N), partial(T.split_heads_in, heads=N, head_dim=H))),
        Recipe(dst + "attn/k", src + "attn_k.weight", (K * H, D),
               (partial(T.llama_cpp_unpermute, heads=K), partial(T.split_heads_in, heads=K, head_dim=H))),
        Recipe(dst + "attn/v", src + "attn_v.weight", (K * H, D),
               (partial(T.split_heads_in, heads=K, head_dim=H),)),
        Recipe(dst + "attn/o", src + "attn_output.weight", (D, N * H),
               (partial(T.split_heads_out, heads=N, head_dim=H),)),
        Recipe(dst + "mlp_norm", src + "ffn_norm.weight", (D,)),
        Recipe(dst + "mlp/gate", src + "ffn_gate.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/up", src + "ffn_up.weight", (F, D), (T.transpose,)),
        Recipe(dst + "mlp/down", src + "ffn_down.weight", (D, F), (T.transpose,)),
    ]


def gguf_name_map(c: ModelConfig) -> NameMap:
    """Map for llama.cpp GGUF files of architecture ``llama`` (shapes in [out, in] order)."""
    if c.qkv_bias or c.o_bias or c.qk_norm:
        raise ConvertError("GGUF llama files carry no attention biases or q/k norms; the config asks for them")
    D, V = c.hidden_size, c.vocab_size
    recipes = [Recipe("embed", "token_embd.weight", (V, D))]
    for i in range(c.num_layers):
        recipes += _gguf_layer(c, i)
    recipes.append(Recipe("final_norm", "output_norm.weight", (D,)))
    if not c.tie_word_embeddings:
        recipes.append(Recipe("lm_head", "output.weight", (V, D), (T.transpose,)))
    return NameMap(tuple(recipes), lambda name: False)


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

    Raises :class:`ConvertError` naming the first missing tensor, unexpected tensor or wrong
    shape (in the source's own layout). ``where`` names the source in the messages.
    """
    names = set(source_names)
    wanted = {r.source for r in name_map.recipes}
    for r in name_map.recipes:
        if r.source not in names:
            raise ConvertError(
                f"{where} has no tensor '{r.source}' (needed for {r.target}); "
                "the checkpoint is incomplete or does not match its config"
            )
    unexpected = sorted(n for n in names - wanted if not name_map.is_ignored(n))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ConvertError(
            f"{where} has an unexpected tensor '{unexpected[0]}'{more}; dayzero does not know what it "
            "computes, so this checkpoint is not of the architecture its config declares"
        )
    for r in name_map.recipes:
        check_shape(r, tuple(shape_of(r.source)), where)
    return name_map.recipes


def check_shape(recipe: Recipe, shape: tuple[int, ...], where: str) -> None:
    """Raise :class:`ConvertError` if a source tensor does not have the shape the config implies."""
    if tuple(shape) != recipe.source_shape:
        raise ConvertError(
            f"tensor '{recipe.source}' in {where} has shape {list(shape)}, expected "
            f"{list(recipe.source_shape)} from the config; the config and the weights disagree"
        )
