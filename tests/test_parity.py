"""Numerical parity with HF transformers, through the real converter.

Each case builds a tiny random HF model (fp32, eager attention, random norms and biases), saves it
with ``save_pretrained``, converts it with ``dayzero.convert.convert_checkpoint`` and loads it with
``load_checkpoint``. Then:

(a) the logits of a 500-token random prompt match HF's;
(b) greedy generation through ``Engine.generate`` is token-for-token HF's ``generate``;
(c) prefill followed by one-token decode steps (``forward`` + ``append_to_cache``) reproduces the
    logits of one full forward pass.

The slow test at the end does (b) for the real embedded SmolLM2-135M-Instruct GGUF.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dayzero.engine import Engine
from dayzero.model.cache import init_cache
from tests.hf_helpers import (
    REL_TOL, STEP_REL_TOL, assert_change_is_effective, assert_logits_match, assert_steps_match_full, convert_case,
    forward_jit, greedy_vs_hf, hf_logits, random_ids,
)

LONG = 500  # long enough that RoPE and sliding-window bugs show
SHORT = 20  # prompt of the greedy-generation comparison
NEW = 32  # tokens generated in the greedy comparison
PREFILL = 480  # (c): prefill this many tokens of the long prompt, decode the rest one at a time
# Tolerances: tests.hf_helpers.REL_TOL (HF logits, 1e-4 * max|ref|) and STEP_REL_TOL ((c), 1e-5).

CASES = {
    # GQA (4 query heads over 2 kv heads), separate lm_head.
    "llama_gqa": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    # MQA (one kv head) and lm_head tied to the embedding.
    "llama_mqa_tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # q/k/v biases.
    "qwen2_bias": ("qwen2", dict(tie_word_embeddings=False)),
    # q/k RMSNorm, and head_dim (32) != hidden / heads (16).
    "qwen3_qknorm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # Sliding window (64) much shorter than the 500-token prompt, on every layer.
    "mistral_swa": ("mistral", dict(sliding_window=64, tie_word_embeddings=False)),
    # Qwen2's mixed layers: layer 0 full attention, layer 1 a 64-token sliding window.
    "qwen2_swa_mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1)),
    "rope_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    # max_position_embeddings=128 so the 500-token prompt is well into the NTK-scaled regime.
    "rope_dynamic": (
        "llama",
        dict(max_position_embeddings=128, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ),
    # original context 128: with theta 5e5 and head_dim 16 the frequencies fall in all three bands
    # (kept, smoothly interpolated, divided by factor).
    "rope_llama3": (
        "llama",
        dict(rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 500000.0,
        }),
    ),
    # factor = 1024 / 256, consistent with max_position_embeddings; attention factor 1 + 0.1 ln 4.
    "rope_yarn": (
        "llama",
        dict(rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0,
        }),
    ),
}


def _ours_from_empty_cache(case, ids: np.ndarray) -> np.ndarray:
    """All-position logits of one pass as the continuation of an empty cache (``all_logits``
    starts from ``cache=None``, as the engine's prefill)."""
    cache = init_cache(case.config, ids.shape[0], ids.shape[1])
    logits, _ = forward_jit(case.weights, case.config, jnp.asarray(ids), cache, all_logits=True)
    return np.asarray(logits)


def _greedy_margin(logits: np.ndarray) -> float:
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


@pytest.fixture(scope="module", params=list(CASES))
def case(request, hf_factory, tmp_path_factory):
    """One converted tiny model, with HF's logits of the long prompt computed once."""
    family, overrides = CASES[request.param]
    hf = hf_factory.build(family, seed=0, **overrides)
    c = convert_case(hf_factory, tmp_path_factory.mktemp(request.param), request.param, hf, LONG)
    c.hf_long = hf_logits(hf, c.long_ids)
    return c


def test_converted_config_matches_case(case):
    """The converter read the features each case is about (else the case tests nothing)."""
    c = case.config
    checks = {
        "llama_gqa": c.num_kv_heads == 2 and not c.tie_word_embeddings,
        "llama_mqa_tied": c.num_kv_heads == 1 and c.tie_word_embeddings and case.weights.lm_head is None,
        "qwen2_bias": c.qkv_bias,
        "qwen3_qknorm": c.qk_norm and c.head_dim == 32,
        "mistral_swa": c.sliding_windows == (64, 64),
        "qwen2_swa_mixed": c.sliding_windows == (None, 64),
        "rope_linear": c.rope.type.value == "linear",
        "rope_dynamic": c.rope.type.value == "dynamic" and c.max_position_embeddings == 128,
        "rope_llama3": c.rope.type.value == "llama3" and c.rope.original_max_position == 128,
        "rope_yarn": c.rope.type.value == "yarn" and c.rope.factor == 4.0,
    }
    assert checks[case.name], c


def test_logits_match_hf(case):
    """(a) fp32 logits of a 500-token prompt: max |ours - HF| <= 1e-4 * max |HF|."""
    assert case.ours_long.shape == case.hf_long.shape
    assert_logits_match(case.ours_long, case.hf_long, case.name)


@pytest.mark.parametrize("case", ["llama_gqa", "mistral_swa"], indirect=True)
def test_empty_cache_equals_no_cache(case):
    """Continuing an empty cache is the same computation as starting without one."""
    ours = _ours_from_empty_cache(case, case.long_ids)
    err = np.abs(ours - case.ours_long).max()
    assert err <= STEP_REL_TOL * np.abs(case.ours_long).max(), err


@pytest.mark.parametrize("case", ["mistral_swa", "qwen2_swa_mixed"], indirect=True)
def test_sliding_window_is_effective(case):
    """The window changes the answer: without it our logits are far from HF's (so (a) tests it)."""
    no_window = dataclasses.replace(case.config, sliding_windows=(None,) * case.config.num_layers)
    assert_change_is_effective(case, no_window)


def test_greedy_generation_matches_hf(case):
    """(b) 32 greedy tokens through Engine.generate are exactly HF generate's."""
    prompt = random_ids(SHORT, case.config.vocab_size, seed=2)
    out, ref = greedy_vs_hf(case, prompt, NEW)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == NEW
    if out.token_ids != ref:
        i = next(k for k, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)
        logits = hf_logits(case.hf, np.array([prompt[0].tolist() + ref[:i]], np.int32))[0, -1]
        pytest.fail(
            f"{case.name}: first divergence at step {i}: ours {out.token_ids[i]}, HF {ref[i]} "
            f"(HF top-2 margin there {_greedy_margin(logits):.3g})"
        )


@pytest.mark.parametrize("case", [name for name in CASES if name != "rope_dynamic"], indirect=True)
def test_prefill_then_decode_matches_full_forward(case, incremental_logits):
    """(c) prefill 480 tokens, decode 20 one at a time: the logits of one 500-token pass.

    Not for dynamic NTK: there the frequencies depend on the longest sequence seen so far. In a
    full pass every position is rotated with the frequencies for length 500; incrementally (in HF
    as here) the keys already in the cache keep the rotation of the length at which they were
    written while later tokens use the grown one. The two are different computations;
    ``test_dynamic_ntk_incremental_matches_hf_cache`` checks what is true instead.
    """
    steps = incremental_logits(case.config, case.weights, case.long_ids, PREFILL)
    assert_steps_match_full(steps, case.ours_long[0, PREFILL - 1 :], case.name)


def _hf_incremental(model, ids: np.ndarray, prefill: int) -> np.ndarray:
    """HF logits at positions prefill-1 .. n-1, prefill then one token at a time with its KV cache."""
    ids_t = torch.from_numpy(ids.astype(np.int64))
    with torch.no_grad():
        # HF's dynamic RoPE module keeps the longest length it has seen; a sequence shorter than
        # the original context resets it, so this run starts from the same state as a fresh model.
        model(ids_t[:, :8])
        out = model(ids_t[:, :prefill], use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, -1]]
        for t in range(prefill, ids.shape[1]):
            out = model(ids_t[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
    return torch.stack(logits).float().numpy()


@pytest.mark.parametrize("case", ["rope_dynamic"], indirect=True)
@pytest.mark.parametrize("prefill", [120, PREFILL], ids=["crossing_context", "beyond_context"])
def test_dynamic_ntk_incremental_matches_hf_cache(case, prefill, incremental_logits):
    """Dynamic NTK, incrementally: same as HF's own incremental decoding with a KV cache.

    With prefill 120 and a context of 128 the decode steps cross the original context, where the
    frequencies start to move; with prefill 480 they move at every step. Each cached key keeps
    the rotation of the step that wrote it (in HF and here), and the incremental result really
    differs from the full pass (checked, so the skip in (c) is not hiding an equality).
    """
    ids = case.long_ids[:, : prefill + 20]
    ours = incremental_logits(case.config, case.weights, ids, prefill)
    ref = _hf_incremental(case.hf, ids, prefill)
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= REL_TOL * scale, f"prefill {prefill}: {err:.3g} vs scale {scale:.3g}"
    full = hf_logits(case.hf, ids)[0, prefill - 1 :]
    assert np.abs(full - ref)[-1].max() > 100 * REL_TOL * scale


@pytest.mark.parametrize("case", ["llama_gqa", "mistral_swa"], indirect=True)
def test_batch_of_ragged_prompts_matches_each_alone(case):
    """A batch of prompts of different lengths gives exactly the tokens each gives alone.

    Lengths 20, 7 and 90 fall in different prompt buckets when alone (32, 16, 128); with the
    mistral case's 64-token window the long row's window slides during prefill and decode while
    the short rows never reach it.
    """
    prompts = [random_ids(n, case.config.vocab_size, seed=10 + n)[0].tolist() for n in (20, 7, 90)]
    batch = case.engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    assert isinstance(batch, list) and len(batch) == len(prompts)
    for prompt, got in zip(prompts, batch):
        alone = case.engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        assert got.prompt_ids == prompt
        assert len(got.token_ids) == 24
        assert got.token_ids == alone.token_ids, f"{case.name}: row of length {len(prompt)}"


# ---- the real embedded model ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_chat_greedy_matches_hf(tmp_path, capsys):
    """SmolLM2-135M-Instruct from its GGUF: ``dayzero generate --chat`` greedy == HF from the same GGUF.

    Both sides dequantize the same Q4_1 file to fp32; the prompt ids are the ones dayzero's
    chat template produced, fed to HF unchanged; HF stops at the same EOS ids.
    """
    from transformers import AutoModelForCausalLM

    from dayzero.convert import convert_checkpoint
    from dayzero.engine.cli import main
    from dayzero.engine.default_model import default_gguf_path

    gguf = default_gguf_path()
    dst = convert_checkpoint(gguf, tmp_path / "smollm2", progress=False)
    rc = main(["generate", "--model", str(dst), "--prompt", "What is the capital of France?",
               "--chat", "--json", "--max-new-tokens", "48"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out["prompt_ids"] and len(out["token_ids"]) >= 1

    engine = Engine.load(dst)
    assert out["prompt_ids"] == engine.tokenizer.encode_chat("What is the capital of France?")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    eos = list(engine.eos_ids)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([out["prompt_ids"]]), do_sample=False, max_new_tokens=48,
            eos_token_id=eos, pad_token_id=eos[0],
        )[0, len(out["prompt_ids"]) :].tolist()
    assert out["token_ids"] == ref, (out["text"], engine.tokenizer.decode(ref))
    assert out["finish_reason"] == ("stop" if ref[-1] in eos else "length")
    assert "Paris" in out["text"]
