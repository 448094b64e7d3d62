"""GGUF recipes of llama.cpp's ``deepseek2`` latent attention (DeepSeek-V3, Kimi-K2).

Per layer: ``attn_q_a`` [Q, D], ``attn_q_a_norm`` [Q] and ``attn_q_b`` [N*(P+R), Q] (or ``attn_q``
[N*(P+R), D] without a q LoRA); ``attn_kv_a_mqa`` [L+R, D]; ``attn_kv_a_norm`` [L];
``attn_output`` [D, N*V]; and the key/value up-projection either as older files store it,
``attn_kv_b`` [N*(P+V), L] (HF's kv_b_proj), or as llama.cpp's converter has written it since its
MLA rewrite, ``attn_k_b`` [N, L, P] and ``attn_v_b`` [N, V, L]. Shapes are in the GGUF reader's
order (numpy's, the reverse of ggml's ``ne``). Rows are HF's (llama.cpp does not permute
deepseek2's q or k: its rotary pairs adjacent elements, as HF's ``rope_interleave``).
"""

from __future__ import annotations

from functools import partial

from dayzero.convert import transforms as T
from dayzero.convert.name_map import Recipe
from dayzero.model.config import ModelConfig


def gguf_mla(c: ModelConfig, src: str, dst: str, split_kv_b: bool) -> list[Recipe]:
    """The latent attention recipes of one layer; ``split_kv_b``: ``attn_k_b``/``attn_v_b``, else ``attn_kv_b``."""
    m, D, N = c.mla, c.hidden_size, c.num_heads
    Q, L, P, R, V = m.q_lora_rank, m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_head_dim
    heads_in = (partial(T.split_heads_in, heads=N, head_dim=P + R),)
    r = [
        Recipe(dst + "attn/kv_a", src + "attn_kv_a_mqa.weight", (L + R, D), (T.transpose,)),
        Recipe(dst + "attn/kv_a_norm", src + "attn_kv_a_norm.weight", (L,)),
        Recipe(dst + "attn/o", src + "attn_output.weight", (D, N * V),
               (partial(T.split_heads_out, heads=N, head_dim=V),)),
    ]
    if split_kv_b:
        r += [Recipe(dst + "attn/k_up", src + "attn_k_b.weight", (N, L, P), (T.mla_k_b,)),
              Recipe(dst + "attn/v_up", src + "attn_v_b.weight", (N, V, L), (T.mla_v_b,))]
    else:
        kv_b = lambda part: (partial(T.split_kv_up, heads=N, nope_dim=P, part=part),)  # noqa: E731
        r += [Recipe(dst + "attn/k_up", src + "attn_kv_b.weight", (N * (P + V), L), kv_b(0)),
              Recipe(dst + "attn/v_up", src + "attn_kv_b.weight", (N * (P + V), L), kv_b(1))]
    if Q is None:
        return r + [Recipe(dst + "attn/q", src + "attn_q.weight", (N * (P + R), D), heads_in)]
    return r + [
        Recipe(dst + "attn/q_a", src + "attn_q_a.weight", (Q, D), (T.transpose,)),
        Recipe(dst + "attn/q_a_norm", src + "attn_q_a_norm.weight", (Q,)),
        Recipe(dst + "attn/q_b", src + "attn_q_b.weight", (N * (P + R), Q), heads_in),
    ]
