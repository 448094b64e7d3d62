"""Shared fixtures: tiny random HF models, a byte-level tokenizer, converted model directories.

The helpers are exposed as fixtures (``hf_factory``, ``tiny_model``) so that test modules never
import this file. Nothing here is autouse: modules that do not ask for a fixture are unaffected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

# The suite compiles from scratch, and writes no persistent compilation cache entries (commands the
# tests run in-process would otherwise turn the cache on for the rest of the worker); the tests of
# the cache pass --compile-cache themselves (engine/compile_cache.py).
os.environ.setdefault("DAYZERO_COMPILE_CACHE", "off")

# A small but non-degenerate decoder: 4 query heads over 2 kv heads, 2 layers.
# initializer_range=0.1 makes the logits O(1), so an absolute comparison of them means something
# (HF's default 0.02 gives logits ~1e-2 that would agree with almost anything).
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# Special tokens of the test tokenizer, placed after the 256 byte tokens.
BOS, EOS = "<|bos|>", "<|eos|>"
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{% for m in messages %}" + BOS + "{{ m['role'] }}\n{{ m['content'] }}" + EOS + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
)


def _config_class(family: str):
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]


def build_hf_model(family: str = "llama", seed: int = 0, **overrides):
    """A tiny random HF causal LM in fp32, eager attention, with non-trivial norms and biases.

    HF initialises norm weights to 1 and biases to 0, which would hide a swapped or missing norm
    or bias in the port; they are drawn at random here.
    """
    import torch

    from tests.hf_helpers import hf_model

    model = hf_model(_config_class(family)(**{**TINY, **overrides}), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def byte_chars() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (the GPT-2 scheme).

    Printable Latin-1 bytes stand for themselves; the other 68 are shifted to 256 + n in order.
    """
    kept = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, shifted = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def write_byte_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer (ids 0-255 are the bytes, no merges) plus BOS=256, EOS=257.

    Writes tokenizer.json, tokenizer_config.json (with a chat template) and a
    generation_config.json naming EOS. Every byte sequence is encodable, so a model's random
    output decodes to text (often with invalid UTF-8, which is exactly what streaming must handle).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = byte_chars()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE})
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID, "bos_token_id": BOS_ID}))


def save_and_convert(model, root: Path, tokenizer: bool = False) -> tuple[Path, Path]:
    """``save_pretrained`` into ``root/hf`` (optionally with the test tokenizer), convert to ``root/dz``."""
    from dayzero.convert import convert_checkpoint

    hf_dir, dz_dir = root / "hf", root / "dz"
    model.save_pretrained(hf_dir)
    if tokenizer:
        write_byte_tokenizer(hf_dir)
    convert_checkpoint(hf_dir, dz_dir, progress=False)
    return hf_dir, dz_dir


@pytest.fixture
def native():
    """The native CPU kernels' library (``kernels/cpu_matvec.py``: the products, the decode
    attention, the decoder layer), built and registered. Skipped only on a host without a C++
    compiler (decode then takes the jnp and XLA paths, which their own tests check); a compiler
    that fails to build it fails the test."""
    from dayzero.kernels import cpu_matvec

    if cpu_matvec._compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX): CPU decode takes the jnp and XLA paths here")
    assert cpu_matvec.available(), f"the native kernels did not build: {cpu_matvec.unavailable_reason()}"


@pytest.fixture(scope="session")
def hf_factory():
    """``build_hf_model`` and ``save_and_convert`` for modules that build their own models."""
    return SimpleNamespace(build=build_hf_model, save_and_convert=save_and_convert, tiny=dict(TINY))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny llama (vocab 260, context 256) converted with the byte-level tokenizer.

    Fields: ``hf`` (the torch model), ``hf_dir``, ``dir`` (converted), ``config``, ``weights``.
    """
    from dayzero.convert import load_checkpoint

    model = build_hf_model("llama", seed=1, vocab_size=260, max_position_embeddings=256)
    hf_dir, dz_dir = save_and_convert(model, tmp_path_factory.mktemp("tiny_model"), tokenizer=True)
    config, weights = load_checkpoint(dz_dir)
    return SimpleNamespace(hf=model, hf_dir=hf_dir, dir=dz_dir, config=config, weights=weights)


@pytest.fixture(scope="session")
def tiny_moe_hf(tmp_path_factory):
    """A tiny Qwen3-MoE HF directory: 8 experts of width 32, top 2 renormalised, 4 query and 4 kv
    heads (so tensor=4 splits whole kv heads), for the runs that put everything on a mesh."""
    import transformers

    from tests.hf_helpers import hf_model

    config = transformers.Qwen3MoeConfig(**{**TINY, "num_key_value_heads": 4, "moe_intermediate_size": 32,
                                            "num_experts": 8, "norm_topk_prob": True, "head_dim": 16})
    hf_dir = tmp_path_factory.mktemp("tiny_moe") / "hf"
    hf_model(config, seed=0).save_pretrained(hf_dir)
    return hf_dir


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    """One shared :class:`Engine` over ``tiny_model`` (tests that count compilations make their own)."""
    from dayzero.engine import Engine

    return Engine.load(tiny_model.dir)



def _incremental_logits(config, weights, ids, prefill: int):
    """Logits [n - prefill + 1, V] at positions prefill-1 .. n-1 of ``ids`` [1, n]: prefill into an
    empty cache (the cache-reading path later prefill chunks take), then one token at a time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dayzero.model.transformer import forward
    from dayzero.model.cache import append_to_cache, init_cache

    step = jax.jit(forward, static_argnums=(1,))
    append = jax.jit(append_to_cache)
    n = ids.shape[1]
    logits, new = step(weights, config, jnp.asarray(ids[:, :prefill]), init_cache(config, 1, n))
    cache = append(init_cache(config, 1, n), new)
    out = [np.asarray(logits[0])]
    for t in range(prefill, n):
        logits, new = step(weights, config, jnp.asarray(ids[:, t : t + 1]), cache)
        cache = append(cache, new)
        out.append(np.asarray(logits[0]))
    assert int(cache.lengths[0]) == n
    return np.stack(out)


@pytest.fixture(scope="module")
def quick_compiles():
    """XLA's optimisation passes off for one module of tiny programs (they cost more to compile
    than they save at run time), restored after it. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("quick_compiles")``."""
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def incremental_logits():
    """``(config, weights, ids, prefill) -> logits`` of prefill followed by one-token decode steps."""
    return _incremental_logits


def _quantized_vs_hf(config, weights, scheme: str, kv: str, long_ids, hf_long, prompt, hf_tokens) -> dict:
    """KL of the quantized model's logits of ``long_ids`` [1, n] against HF's ``hf_long`` [1, n, V],
    and its teacher-forced greedy agreement with HF's tokens ``hf_tokens`` after ``prompt`` [1, m],
    both read through the cache in chunks as generation does (``dayzero.tools.quality``)."""
    import numpy as np

    from dayzero.engine import Engine
    from dayzero.engine.generate import bucket
    from dayzero.tools.quality import CHUNK, sequence_logits
    from dayzero.tools.verify import logits_stats
    from dayzero.model.quant import QuantConfig, parse_weight_quant
    from dayzero.model.weights import abstract_weights, quantize_weights

    quantized = quantize_weights(weights, abstract_weights(config, QuantConfig(parse_weight_quant(scheme))))
    engine = Engine(config, quantized, kv_cache=kv)
    length = bucket(long_ids.shape[1] + CHUNK, CHUNK)  # one cache length: both runs share their compiles
    stats = logits_stats(hf_long[0], sequence_logits(engine, long_ids[0].tolist(), cache_len=length))
    m = prompt.shape[1]
    predicted = sequence_logits(engine, prompt[0].tolist() + list(hf_tokens), cache_len=length)
    predicted = predicted[m - 1 : m - 1 + len(hf_tokens)].argmax(-1)
    return {"kl_mean": stats["kl_mean"], "kl_max": stats["kl_max"],
            "greedy_agreement": float(np.mean(predicted == np.asarray(hf_tokens)))}


@pytest.fixture(scope="session")
def quantized_vs_hf():
    """``(case, scheme, kv, prompt_len, new) -> result`` for a parity case of tests.hf_helpers:
    its model quantized by ``scheme`` / ``kv`` against HF over the case's long prompt, and over
    HF's ``new`` greedy tokens after a random ``prompt_len``-token prompt (seed 2), returned
    for the test to check with ``tests.hf_helpers.within_moe_gates``."""
    def measure(case, scheme: str, kv: str, prompt_len: int, new: int):
        from tests.hf_helpers import hf_greedy, random_ids

        prompt = random_ids(prompt_len, case.config.vocab_size, seed=2)
        return _quantized_vs_hf(case.config, case.weights, scheme, kv, case.long_ids, case.hf_long, prompt,
                                hf_greedy(case.hf, prompt, new))
    return measure
