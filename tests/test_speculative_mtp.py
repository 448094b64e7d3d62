"""Speculative decoding with DeepSeek-V3's own multi-token-prediction module (model/mtp.py,
engine/mtp_drafter.py): the module's math, its conversion (also under Kimi-K2's model_type),
lossless generation, the refusals. GLM-4.5's module: tests/test_speculative_mtp_glm.py.

Oracles:
- HF transformers' ``MtpModel`` (the generic MTP module its DeepSeek-V3 drafts with, built on the
  same HF main model): the module's logits over a 64-token prompt match HF's; the converted
  module is the checkpoint's, and a model converted without it is refused by ``--speculative mtp``.
- A "mirror" model: a one-layer main model whose embedding rows have RMS 1 (so ``enorm`` is the
  identity), ``eh_proj`` = [I; 0] (the hidden half ignored), the module's layer a copy of layer 0
  and its head norm the final norm. Its module then computes the main model over the sequence
  shifted by one token: its logits at entry i are the main model's over s[1:] at position i, and
  its greedy drafts are the main model's greedy continuation of the sequence without its first
  token. With attention switched off (a context-free model) the drafts are exactly what the
  target picks: every draft accepted.
- Greedy speculative output is the plain engine's (test_speculative's lossless helper); sampled
  drafts are distributed as the q they report, and the verify step's first emitted token as the
  target's p (HF's warpers), checked by chi-square and checked to fail when the drafter reports
  a q other than the one it drew from.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from scipy import stats

from dayzero.convert import ConvertError, convert_checkpoint, load_checkpoint
from dayzero.engine import Engine
from dayzero.engine.sampling import batch_sampling
from dayzero.engine.speculative import SpecConfig, SpeculativeError, accept_drafts, target_logits
from dayzero.model.cache import append_to_cache, init_cache
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.mtp import NextNWeights, main_hidden, nextn_block_config, nextn_forward, nextn_logits
from dayzero.model.transformer import forward
from dayzero.model.weights import Init, abstract_weights, map_specs
from tests.test_speculative import EMISSION_PARAMS, _hf_target, _repetitive_prompts
from tests.test_speculative import _assert_lossless as assert_lossless

K, NEW, VOCAB = 3, 16, 64
SKEW = 0.02  # the spread of the noise added to the mirror module's eh_proj in the sampled test

TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1, first_k_dense_replace=0,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _mirror(attention: bool = True, seed: int = 0):
    """(config, weights) of the mirror model (module docstring); ``attention`` False zeroes the
    attention's output projection in layer 0 and its copy."""
    config = dataclasses.replace(parse_hf_config(transformers.DeepseekV3Config(**TINY).to_dict()), mtp_kept=True)
    rng = np.random.default_rng(seed)  # drawn on the host: jax.random would compile a kernel per shape

    def draw(spec):
        if spec.init is not Init.NORMAL:
            return jnp.full(spec.shape, 1.0 if spec.init is Init.ONES else 0.0, jnp.float32)
        return jnp.asarray(rng.normal(0.0, 0.3, spec.shape), jnp.float32)

    w = map_specs(draw, abstract_weights(config))
    embed = w.embed * jax.lax.rsqrt(jnp.mean(w.embed**2, axis=-1, keepdims=True))
    layer = w.layers[0]
    if not attention:
        layer = layer.replace(attn=layer.attn.replace(o=jnp.zeros_like(layer.attn.o)))
    D = config.hidden_size
    ones = jnp.ones((D,), jnp.float32)
    mtp = NextNWeights(enorm=ones, hnorm=ones, eh_proj=jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]),
                       layer=layer, norm=w.final_norm)
    return config, w.replace(embed=embed, layers=(layer,), mtp=(mtp,))


@pytest.fixture(scope="module")
def mirror():
    return _mirror()


@functools.partial(jax.jit, static_argnums=(1,))
def _main_hidden(w, config, ids):
    """The main model's hidden states [B,n,D] over ``ids`` (after its final norm)."""
    layers = []
    forward(w, config, ids, hidden_out=layers)
    return main_hidden(w, config, layers[-1])


@functools.partial(jax.jit, static_argnums=(1,))
def _main_logits(w, config, ids):
    return forward(w, config, ids, all_logits=True)[0]


@functools.partial(jax.jit, static_argnums=(1,))
def _module_step(w, config, tokens, hidden, cache):
    """The module's output over new entries and its cache written with them."""
    out, new = nextn_forward(w.mtp[0], w, config, tokens, hidden, cache)
    return out, append_to_cache(cache, new)


@functools.partial(jax.jit, static_argnums=(1,))
def _head(w, config, out):
    return nextn_logits(w.mtp[0], w, config, out)


def _module_logits(w, config, ids):
    """The module's logits at entries 0..n-2 of ``ids`` [B,n] (token ids[i+1], hidden h[i]), in one pass."""
    cache = init_cache(nextn_block_config(config), ids.shape[0], 128)
    return _head(w, config, _module_step(w, config, ids[:, 1:], _main_hidden(w, config, ids)[:, :-1], cache)[0])


def _in_pieces(w, config, tokens, hidden, split: int, use_cache: bool = True):
    """The module over entries [0, split) into its cache, then the rest one entry at a time
    (reading the cache, or with ``use_cache`` False an empty one)."""
    B, n = tokens.shape
    empty = init_cache(nextn_block_config(config), B, 128)
    out, cache = _module_step(w, config, tokens[:, :split], hidden[:, :split], empty)
    outs = [out]
    for i in range(split, n):
        out, cache = _module_step(w, config, tokens[:, i:i + 1], hidden[:, i:i + 1], cache if use_cache else empty)
        outs.append(out)
    return _head(w, config, jnp.concatenate(outs, axis=1))


def _close(a, b) -> bool:
    return bool(np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-4 * np.abs(np.asarray(b)).max())


# ---- the module's math ---------------------------------------------------------------------------


def test_mirror_module_is_the_main_model_shifted_by_one(mirror):
    """The mirror module's logits at entry i are the main model's over s[1:] at position i: in one
    pass, and in pieces through its cache. Fails for unshifted tokens or steps without the cache."""
    config, w = mirror
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 30)), jnp.int32)
    ref = _main_logits(w, config, ids[:, 1:])
    assert _close(_module_logits(w, config, ids), ref)
    h = _main_hidden(w, config, ids)[:, :-1]
    assert _close(_in_pieces(w, config, ids[:, 1:], h, 20), ref)
    # The controls: t[i] paired with h[i] (no shift), and decode steps that skip the cache.
    assert not _close(_in_pieces(w, config, ids[:, :-1], h, 20), ref)
    assert not _close(_in_pieces(w, config, ids[:, 1:], h, 20, use_cache=False), ref)


# ---- HF's MtpModel and the converter --------------------------------------------------------------


LAYERS = 2  # main layers of the HF model; its MTP module is stored as layer 2


def save_with_mtp(big, root, layers: int, seed: int) -> tuple:
    """HF's ``MtpModel`` on ``main``, the first ``layers`` layers of the HF model ``big``, with
    ``big``'s last layer as its decoder layer and its norms and ``eh_proj`` random (``seed``);
    saved under ``root / "hf"`` as the releases store it: the module as layer ``layers`` with
    enorm/hnorm/eh_proj/shared_head (its decoder layer spelt as a main layer's) and copies of
    the embedding and head. Returns (main, the MtpModel, the module's extra tensors by name, the
    checkpoint's directory)."""
    from transformers.modeling_layers import MtpModel

    from tests.hf_helpers import copy_hf_checkpoint

    big.save_pretrained(root / "big")
    main = type(big)(type(big.config)(**{**big.config.to_dict(), "num_hidden_layers": layers})).eval()
    main.load_state_dict({k: v for k, v in big.state_dict().items() if f"layers.{layers}." not in k})
    mtp = MtpModel(main, 1).eval()
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(big.model.layers[layers].state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in (layer.enorm.weight, layer.hnorm.weight, layer.post_norm.weight):
            p.normal_(1.0, 0.1)
        layer.eh_proj.weight.normal_(0.0, 0.1)
    src = f"model.layers.{layers}."
    extra = {src + "enorm.weight": layer.enorm.weight, src + "hnorm.weight": layer.hnorm.weight,
             src + "eh_proj.weight": layer.eh_proj.weight, src + "shared_head.norm.weight": layer.post_norm.weight,
             src + "shared_head.head.weight": main.lm_head.weight, src + "embed_tokens.weight": main.model.embed_tokens.weight}
    extra = {k: v.detach().clone().contiguous() for k, v in extra.items()}

    def config(raw):
        raw.update(num_hidden_layers=layers, num_nextn_predict_layers=1)

    return main, mtp, extra, copy_hf_checkpoint(root / "big", root / "hf", config, lambda t: t.update(extra))


@pytest.fixture(scope="module")
def hf_mtp(tmp_path_factory):
    """An HF DeepSeek-V3 main model with a random MTP module (HF's ``MtpModel``), saved as the
    release stores it (the module as layer 2 with enorm/hnorm/eh_proj/shared_head, its decoder
    layer spelt as a main layer's, and copies of the embedding and head), and converted."""
    from tests.test_deepseek import SEEDS, build_hf_deepseek

    root = tmp_path_factory.mktemp("mtp")
    # A three-layer model's last layer becomes the module's decoder layer, saved in the
    # published per-expert spelling by save_pretrained.
    big = build_hf_deepseek("q_lora", SEEDS["q_lora"], num_hidden_layers=LAYERS + 1)
    main, mtp, extra, hf_dir = save_with_mtp(big, root, LAYERS, seed=5)
    convert_checkpoint(hf_dir, root / "dz", progress=False)
    config, weights = load_checkpoint(root / "dz", dtype=jnp.float32)
    return SimpleNamespace(main=main, mtp=mtp, root=root, hf_dir=hf_dir, extra=extra, config=config, weights=weights)


def test_module_logits_match_hf(hf_mtp):
    """HF's MtpModel over the main model's last hidden states (after its final norm): the same
    logits over a 64-token prompt (the cache path is checked on the mirror model above)."""
    assert_module_matches_hf(hf_mtp, "MTP module")


def assert_module_matches_hf(case, name: str) -> None:
    """The converted module's logits over a 64-token prompt are HF's ``MtpModel``'s over the HF
    main model's last hidden states (``case``: a fixture's main, mtp, config and weights)."""
    from tests.hf_helpers import assert_logits_match

    ids = np.random.default_rng(3).integers(0, case.config.vocab_size, (1, 64))
    t = torch.from_numpy(ids)
    with torch.no_grad():
        h = case.main(t, output_hidden_states=True).hidden_states[-1]
        x = case.mtp.forward_layer(0, h[:, :-1], torch.arange(1, 64)[None], None, input_ids=t[:, 1:])
        ref = case.mtp._project_to_logits(x).numpy()
    ours = _module_logits(case.weights, case.config, jnp.asarray(ids, jnp.int32))
    assert_logits_match(np.asarray(ours), ref, name)


def test_conversion_keeps_the_module(hf_mtp, tmp_path):
    """The module's tensors land in ``Weights.mtp`` (its layer as the same layer converted as a
    main one); ``check`` lists only the embedding/head copies as ignored; a missing tensor, a
    wrong shape and a layer past the module are refused by name; without them the model converts
    without the module (and the MTP drafter refuses it)."""
    from dayzero.convert.check import check_source
    from tests.hf_helpers import copy_hf_checkpoint

    c, w = hf_mtp.config, hf_mtp.weights
    assert c.mtp_kept and c.mtp_layers == 1
    m, e = w.mtp[0], hf_mtp.extra
    src = f"model.layers.{LAYERS}."
    np.testing.assert_array_equal(m.enorm, e[src + "enorm.weight"].numpy())
    np.testing.assert_array_equal(m.eh_proj, e[src + "eh_proj.weight"].numpy().T)
    np.testing.assert_array_equal(m.norm, e[src + "shared_head.norm.weight"].numpy())
    convert_checkpoint(hf_mtp.root / "big", tmp_path / "big", progress=False)
    big = load_checkpoint(tmp_path / "big", dtype=jnp.float32)[1].layers[LAYERS]
    for (_, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(m.layer), jax.tree_util.tree_leaves_with_path(big)):
        np.testing.assert_array_equal(a, b)
    structure = check_source(hf_mtp.hf_dir).structure
    assert structure["ignored"] == [src + "embed_tokens.weight", src + "shared_head.head.weight"]
    assert "+ 1 MTP kept" in structure["config"] and not structure["missing"]
    for name, edit in [(src + "hnorm.weight", lambda t: t.pop(src + "hnorm.weight")),
                       (src + "eh_proj.weight", lambda t: t.update({src + "eh_proj.weight": torch.zeros(64, 64)})),
                       (f"model.layers.{LAYERS + 1}.enorm.weight",
                        lambda t: t.update({f"model.layers.{LAYERS + 1}.enorm.weight": torch.ones(64)}))]:
        bad = copy_hf_checkpoint(hf_mtp.hf_dir, tmp_path / name, tensors_edit=edit)
        with pytest.raises(ConvertError, match=name.replace(".", r"\.")):
            convert_checkpoint(bad, tmp_path / (name + "dz"), progress=False)
    plain = copy_hf_checkpoint(hf_mtp.hf_dir, tmp_path / "plain",
                               tensors_edit=lambda t: [t.pop(k) for k in list(t) if k.startswith(src)])
    config = load_checkpoint(convert_checkpoint(plain, tmp_path / "plain_dz", progress=False))[0]
    assert not config.mtp_kept and config.mtp_layers == 1
    with pytest.raises(SpeculativeError, match="converted without its multi-token-prediction layers"):
        Engine.load(tmp_path / "plain_dz", progress=False).generate([1, 2, 3], speculative=SpecConfig("mtp"))


def test_kimi_k2_keeps_the_same_module(hf_mtp, tmp_path):
    """Kimi-K2 is DeepSeek-V3's architecture under its own model_type: a source with the module
    converts it too, to the same weights and the same logits."""
    from tests.hf_helpers import copy_hf_checkpoint

    def kimi(raw):
        raw.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})

    src = copy_hf_checkpoint(hf_mtp.hf_dir, tmp_path / "kimi", kimi)
    config, weights = load_checkpoint(convert_checkpoint(src, tmp_path / "dz", progress=False), dtype=jnp.float32)
    assert config.family.value == "kimi_k2" and config.mtp_kept
    for a, b in zip(jax.tree_util.tree_leaves(weights.mtp), jax.tree_util.tree_leaves(hf_mtp.weights.mtp)):
        np.testing.assert_array_equal(a, b)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (1, 16)), jnp.int32)
    np.testing.assert_array_equal(_module_logits(weights, config, ids),
                                  _module_logits(hf_mtp.weights, hf_mtp.config, ids))


@pytest.mark.slow
def test_greedy_is_lossless_with_the_converted_module(hf_mtp):
    """The converted (random) module drafts; the output is plain greedy output."""
    engine = Engine(hf_mtp.config, hf_mtp.weights, kernels="reference")
    prompts = _repetitive_prompts(hf_mtp.config.vocab_size)
    plain = engine.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    fast = engine.generate(prompts, max_new_tokens=NEW, ignore_eos=True, speculative=SpecConfig("mtp", num_draft_tokens=K))
    assert [f.token_ids for f in fast] == [p.token_ids for p in plain]
    assert all(f.speculation.drafted > 0 for f in fast)


# ---- through Engine.generate ------------------------------------------------------------------------


@pytest.mark.slow
def test_mirror_drafts_are_the_shifted_greedy_continuation(mirror, monkeypatch):
    """Every proposal of the mirror module is the main model's greedy continuation of the
    sequence so far without its first token; the output is plain greedy output (drafts accepted
    and rejected: the target sees the first token, the module does not)."""
    from dayzero.engine import mtp_drafter

    config, w = mirror
    engine = Engine(config, w, kernels="reference")
    proposals = []
    propose = mtp_drafter.MTPDrafter.propose

    def recording(self, active, produced, k):
        drafts, q = propose(self, active, produced, k)
        proposals.append((produced.copy(), drafts))
        return drafts, q

    monkeypatch.setattr(mtp_drafter.MTPDrafter, "propose", recording)
    # Short prompts: the first token, which the module does not see, weighs enough in the
    # target's attention to reject drafts (after 35+ tokens every draft passed).
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (2, 3, 5)]
    fast = assert_lossless(engine, prompts, NEW, SpecConfig("mtp", num_draft_tokens=K))
    assert proposals
    for produced, drafts in proposals:
        for b, prompt in enumerate(prompts):
            if produced[b] + 1 >= NEW:
                continue  # the row had no room for drafts
            seq = prompt + fast[b].token_ids[: produced[b]]
            want = engine.generate(seq[1:], max_new_tokens=K, ignore_eos=True).token_ids
            assert drafts[b].tolist() == want, (b, produced[b])


@pytest.mark.slow
def test_context_free_mirror_accepts_every_draft():
    """Without attention the main model at position i+1 and the module at entry i compute the
    same function of the same token: every draft is accepted, and the output is plain greedy."""
    config, w = _mirror(attention=False)
    engine = Engine(config, w, kernels="reference")
    fast = assert_lossless(engine, _repetitive_prompts(VOCAB), NEW, SpecConfig("mtp", num_draft_tokens=K),
                           all_accepted=True)
    assert all(f.speculation.to_json()["acceptance_rate"] == 1.0 for f in fast)


@pytest.mark.slow
def test_sampled_drafts_follow_q_and_the_emission_follows_p(mirror):
    """Many rows drafting after the same prompt (seeds 0..N-1), with the mirror module's
    ``eh_proj`` perturbed (its q then differs from the target's p): the first draft is
    distributed as the q the drafter reports, and the verify step's first emitted token as the
    target's p (HF's warpers), with some drafts accepted; a q reported as p instead (a drafter
    claiming to draw what the target would) fails the second check."""
    from dayzero.engine.mtp_drafter import MTPDrafter

    config, w = mirror
    m = w.mtp[0]
    noise = np.random.default_rng(2).normal(0.0, SKEW, m.eh_proj.shape)
    w = w.replace(mtp=(m.replace(eh_proj=m.eh_proj + jnp.asarray(noise, jnp.float32)),))
    engine = Engine(config, w, kernels="reference")
    N, first = 2000, 7
    prompt = np.random.default_rng(1).integers(0, VOCAB, 10).tolist()
    for params in EMISSION_PARAMS:
        mode, rows = batch_sampling([dataclasses.replace(params, seed=i) for i in range(N)])
        *_, hidden = engine._prefill_chunks([prompt] * N, np.full(N, len(prompt)), 4 + 2, rows, mode, hidden=True)
        drafter = MTPDrafter(engine, [prompt] * N, np.full(N, first), hidden, 4, 2, rows, mode)
        drafts, q = drafter.propose(np.ones(N, bool), np.ones(N, np.int32), 2)
        q0 = np.asarray(q[0, 0], np.float64)
        assert _chi2_p(np.bincount(drafts[:, 0], minlength=VOCAB), q0 * N) > 1e-6
        tokens = jnp.concatenate([jnp.asarray([prompt + [first]] * N, jnp.int32), jnp.asarray(drafts)], axis=1)
        logits = _main_logits(w, config, tokens)[:, -3:]
        p0 = _hf_target(np.asarray(logits[0, 0]), params)

        def emitted(draft_probs):
            out, _, accepted = accept_drafts(logits, jnp.asarray(drafts), jnp.full((N,), 2, jnp.int32), rows,
                                             jnp.ones((N,), jnp.int32), mode, draft_probs)
            return np.asarray(out[:, 0]), np.asarray(accepted)

        out, accepted = emitted(q)
        assert accepted.mean() > 0.1 and (accepted == 0).any()
        assert _chi2_p(np.bincount(out, minlength=VOCAB), p0 * N) > 1e-6
        if params.top_k == 0:  # the filtered p leaves 2 tokens here, too few to see the control fail
            as_p = jax.nn.softmax(target_logits(logits[:, :2], rows, mode), axis=-1)
            assert _chi2_p(np.bincount(emitted(as_p)[0], minlength=VOCAB), p0 * N) < 1e-6


def _chi2_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square p-value of ``counts`` against ``expected`` (no count where nothing is expected)."""
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    chi2 = (((counts - expected) ** 2)[live] / expected[live]).sum()
    return float(stats.chi2.sf(chi2, live.sum() - 1))


# ---- refusals and the command line ----------------------------------------------------------------


def test_models_without_mtp_layers_are_refused(tiny_engine, mirror, tmp_path):
    config, w = mirror
    with pytest.raises(SpeculativeError, match="not llama; use --speculative ngram or draft:DIR"):
        tiny_engine.generate([1, 2, 3], max_new_tokens=2, speculative=SpecConfig("mtp"))
    none = dataclasses.replace(config, mtp_layers=0, mtp_kept=False)
    with pytest.raises(SpeculativeError, match="num_nextn_predict_layers is 0"):
        Engine(none, w.replace(mtp=None), kernels="reference").generate([1, 2], speculative=SpecConfig("mtp"))
    with pytest.raises(SpeculativeError, match="only it takes one"):
        SpecConfig("mtp", draft=tiny_engine)


def test_cli_mtp_refusals_are_one_line(tiny_model, capsys):
    from tests.test_cli import _assert_one_line_error, _run

    base = ["generate", "--model", tiny_model.dir, "--prompt-ids", "1,2,1,2", "--speculative", "mtp"]
    _assert_one_line_error(*_run([*base, "--ngram", "1,2"], capsys), "--speculative mtp")
    _assert_one_line_error(*_run(base, capsys), "multi-token-prediction")
