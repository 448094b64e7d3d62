"""GGUF conversion of llama.cpp's ``deepseek2`` architecture (DeepSeek-V3's latent attention and
MoE), checked against HF transformers running the original model.

transformers 5.24 cannot load a deepseek2 GGUF, so the oracle is the HF model the file is written
from: a tiny random HF DeepseekV3 (fp32, random norms and selection biases, group-limited
sigmoid routing, shared expert, one leading dense layer, YaRN) is written as a GGUF the way
llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) lays deepseek2 out: names from
the gguf package's TensorNameMap, experts stacked, the selection bias as ``exp_probs_b.bias``, q
and k rows unpermuted, and its metadata keys; ``kv_b_proj`` split per head into ``attn_k_b``
[N, L, P] (transposed) and ``attn_v_b`` [N, V, L] with head_count_kv 1 and key/value_length_mla
(current files), or kept as ``attn_kv_b`` (older files). dayzero converts the GGUF; its logits
must equal HF's on the original model. The layout transforms are what is under test: the sizes
are all different (L 32, P 16, R 8, V 12), so a wrong split or transpose is a shape error or
moves the logits. Checked by hand once: ``attn_v_b`` read as [N, L, V] -> max logit diff 5.4 (scale
3.5); llama.cpp's llama q unpermute applied to ``attn_q_b`` -> 3.9; ``attn_k_b`` transposed the
wrong way, or ``attn_kv_b``'s key and value parts swapped -> shape errors; the YaRN multiplier
dropped -> mscale None.

Default suite: the q-LoRA model in both layouts, refusals, metadata (~10 s); slow: no q LoRA.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from dayzero.convert import ConvertError, load_checkpoint
from dayzero.model.config import Family
from tests import test_deepseek
from tests.convert_helpers import assert_fails, convert
from tests.hf_helpers import MIN_ROUTER_GAP, all_logits, assert_logits_match, hf_logits, random_ids
from tests.test_convert_gguf import add_gguf_tokenizer, byte_level_vocab, write_gguf_tensors

# All sizes differ, so a transform that mixes two of them up cannot pass; mscale == mscale_all_dim
# as llama.cpp assumes (it stores only 0.1 * mscale_all_dim, as yarn_log_multiplier).
SIZES = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=0.8,
            mscale_all_dim=0.8)
LONG = 100


def tiny_deepseek(case: str):
    """test_deepseek's tiny model (``q_lora`` or ``no_q_lora``) with the sizes above and the GGUF vocabulary."""
    return test_deepseek.build_hf_deepseek(case, test_deepseek.SEEDS[case], vocab_size=len(byte_level_vocab()[0]),
                                           rope_parameters=YARN, **SIZES)


def deepseek2_tensors(model, split_kv_b: bool) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for an HF DeepseekV3 model."""
    c = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    N, P, V = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    out = {}
    for hf, value in model.state_dict().items():
        value = value.float().numpy()
        blk = f"blk.{hf.split('.')[2]}." if hf.startswith("model.layers.") else None
        if hf.endswith("mlp.experts.gate_up_proj"):  # transformers' fused [E, 2F, D]: gate rows first
            F = value.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = value[:, :F], value[:, F:]
        elif hf.endswith("mlp.experts.down_proj"):
            out[blk + "ffn_down_exps.weight"] = value
        elif hf.endswith("mlp.gate.e_score_correction_bias"):
            out[blk + "exp_probs_b.bias"] = value
        elif hf.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = value.reshape(N, P + V, value.shape[-1])
            out[blk + "attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :P].transpose(0, 2, 1))  # [N, L, P]
            out[blk + "attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, P:])  # [N, V, L]
        elif not (hf == "lm_head.weight" and c.tie_word_embeddings):
            base, suffix = hf.rsplit(".", 1)
            out[f"{names.get_name(base)}.{suffix}"] = value
    return out


def add_deepseek2_hparams(w: gguf.GGUFWriter, c, split_kv_b: bool) -> None:
    """The metadata DeepseekV2Model.set_gguf_parameters writes (newer files: MLA lengths, one kv head)."""
    L, P, R, V = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if split_kv_b else c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(L)
    if split_kv_b:
        w.add_key_length(L + R)
        w.add_value_length(L)
        w.add_key_length_mla(P + R)
        w.add_value_length_mla(V)
    else:
        w.add_key_length(P + R)
        w.add_value_length(V)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(R)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_deepseek2_gguf(path, model, split_kv_b: bool = True, edit=None):
    """A deepseek2 GGUF of ``model``; ``edit(tensors)`` may change the tensors before writing."""
    w = gguf.GGUFWriter(path, "deepseek2")
    add_deepseek2_hparams(w, model.config, split_kv_b)
    add_gguf_tokenizer(w, "deepseek-v3")  # as DeepSeek-V3 files name their pre-tokenizer
    tensors = deepseek2_tensors(model, split_kv_b)
    if edit:
        edit(tensors)
    write_gguf_tensors(w, tensors)
    return path


@pytest.fixture(scope="module")
def q_lora():
    """The q-LoRA model and HF's logits of a 100-token prompt (its routing clear of ties)."""
    model = tiny_deepseek("q_lora")
    ids = random_ids(LONG, model.config.vocab_size, seed=1)
    assert test_deepseek.hf_min_gap(model, ids) > MIN_ROUTER_GAP
    return model, ids, hf_logits(model, ids)


def assert_deepseek2_gguf_matches(tmp_path, model, ids, ref, split_kv_b: bool):
    """Write ``model`` as a deepseek2 GGUF, convert it and assert the config it reads and that its
    logits equal HF's ``ref`` within hf_helpers.REL_TOL (1e-4 relative). Measured: 8.8e-7 relative;
    a head order reversed in attn_k_b, attn_v_b or attn_kv_b, or the selection bias reversed, moved
    the logits by 0.88-1.2 relative."""
    src = write_deepseek2_gguf(tmp_path / "ds.gguf", model, split_kv_b)
    config, weights = load_checkpoint(convert(src, tmp_path / "out"))
    assert config.family is Family.DEEPSEEK_V3 and config.mla.rope_interleave
    assert (config.moe.num_groups, config.moe.groups_per_token, config.moe.routed_scaling) == (2, 1, 2.5)
    assert config.rope.mscale == config.rope.mscale_all_dim == 0.8
    assert_logits_match(all_logits(weights, config, ids), ref, f"deepseek2 split_kv_b={split_kv_b}")


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b_v_b", "kv_b"])
def test_deepseek2_gguf_matches_hf_original(tmp_path, q_lora, split_kv_b):
    assert_deepseek2_gguf_matches(tmp_path, *q_lora, split_kv_b)


@pytest.mark.slow
def test_deepseek2_gguf_without_q_lora(tmp_path):
    model = tiny_deepseek("no_q_lora")
    ids = random_ids(LONG, model.config.vocab_size, seed=1)
    assert test_deepseek.hf_min_gap(model, ids) > MIN_ROUTER_GAP
    assert_deepseek2_gguf_matches(tmp_path, model, ids, hf_logits(model, ids), True)


def test_deepseek2_gguf_refusals(tmp_path, q_lora):
    model = q_lora[0]
    # Both layouts at once: the new one is read and the old tensor is not expected.
    src = write_deepseek2_gguf(tmp_path / "both.gguf", model,
                               edit=lambda t: t.update({"blk.0.attn_kv_b.weight": np.zeros((4 * 28, 32), np.float32)}))
    assert_fails(src, tmp_path / "o1", "unexpected tensor 'blk.0.attn_kv_b.weight'")
    src = write_deepseek2_gguf(tmp_path / "half.gguf", model, edit=lambda t: t.pop("blk.2.attn_v_b.weight"))
    assert_fails(src, tmp_path / "o2", "blk.2.attn_v_b.weight")


def deepseek2_meta(**changes):
    from dayzero.convert.gguf_config import hf_config_from_gguf

    meta = {"general.architecture": "deepseek2", "deepseek2.block_count": 2, "deepseek2.context_length": 1024,
            "deepseek2.embedding_length": 64, "deepseek2.feed_forward_length": 96, "deepseek2.attention.head_count": 4,
            "deepseek2.attention.head_count_kv": 1, "deepseek2.rope.freq_base": 10000.0,
            "deepseek2.attention.layer_norm_rms_epsilon": 1e-5, "deepseek2.attention.kv_lora_rank": 32,
            "deepseek2.attention.key_length": 40, "deepseek2.attention.value_length": 32,
            "deepseek2.attention.key_length_mla": 24, "deepseek2.attention.value_length_mla": 12,
            "deepseek2.rope.dimension_count": 8, "deepseek2.expert_count": 8, "deepseek2.expert_used_count": 2,
            "deepseek2.expert_feed_forward_length": 32, "deepseek2.expert_gating_func": 2,
            "deepseek2.leading_dense_block_count": 1}
    meta = {k: v for k, v in {**meta, **changes}.items() if v is not None}
    return hf_config_from_gguf(meta.get, list(meta), 256, has_output=True)


def test_deepseek2_metadata_translation():
    from dayzero.model.hf_config import parse_hf_config

    c = parse_hf_config(deepseek2_meta())
    assert (c.mla.q_lora_rank, c.mla.nope_dim, c.mla.rope_dim, c.mla.v_head_dim, c.num_kv_heads) == (None, 16, 8, 12, 4)
    assert c.moe.layers == (False, True)
    assert (c.moe.num_groups, c.moe.shared_experts, c.moe.renormalize) == (1, 0, False)
    for gating in (None, 1):  # no key: llama.cpp reads softmax (DeepSeek-V2)
        with pytest.raises(ConvertError, match="only sigmoid routing"):
            deepseek2_meta(**{"deepseek2.expert_gating_func": gating})
    with pytest.raises(ConvertError, match="key_length=24"):
        deepseek2_meta(**{"deepseek2.attention.key_length": 24})
    older = {"deepseek2.attention.key_length": 24, "deepseek2.attention.value_length": 12,
             "deepseek2.attention.key_length_mla": None, "deepseek2.attention.value_length_mla": None}
    assert parse_hf_config(deepseek2_meta(**older, **{"deepseek2.attention.head_count_kv": 4})).mla == c.mla
    with pytest.raises(ConvertError, match="head_count_kv=1 without key_length_mla"):
        deepseek2_meta(**older)
    with pytest.raises(ConvertError, match="deepseek2.nextn_predict_layers"):
        deepseek2_meta(**{"deepseek2.nextn_predict_layers": 1})
