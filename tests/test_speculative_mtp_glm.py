"""GLM-4.5's multi-token-prediction module (``glm4_moe``, ``num_nextn_predict_layers``): kept by
the converter and run by the MTP drafter as DeepSeek-V3's is (tests/test_speculative_mtp.py),
over grouped-query attention with q/k/v biases, q/k norms and partial RoPE.

Oracle: HF transformers' generic ``MtpModel`` built on an HF Glm4Moe main model (as HF's own
``generate(use_mtp=True)`` builds it): the converted module's logits over a 64-token prompt are
its. Greedy speculative output through ``Engine.generate`` and through the paged server (the
module on its own page pool, float and int8 KV) is plain greedy output, and the server's drafts
are ``generate``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from dayzero.convert import convert_checkpoint, load_checkpoint
from dayzero.engine import Engine, ServingConfig, mtp_drafter, serving_mtp
from dayzero.engine.speculative import SpecConfig
from dayzero.model.config import AttentionKind, Family
from tests.test_glm4_moe import SEED, build_hf_glm
from tests.test_speculative import _repetitive_prompts
from tests.test_speculative_mtp import assert_module_matches_hf, save_with_mtp

LAYERS = 2  # main layers of the HF model; its MTP module is stored as layer 2 (a MoE layer)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """An HF Glm4Moe main model with a random MTP module (HF's ``MtpModel``), saved as GLM-4.5
    stores it (layer 2 with enorm/hnorm/eh_proj/shared_head, its decoder layer spelt as a main
    layer's, copies of the embedding and head), and converted."""
    root = tmp_path_factory.mktemp("glm_mtp")
    big = build_hf_glm(SEED, num_hidden_layers=LAYERS + 1)  # its last layer becomes the module's
    main, mtp, extra, hf_dir = save_with_mtp(big, root, LAYERS, seed=7)
    convert_checkpoint(hf_dir, root / "dz", progress=False)
    config, weights = load_checkpoint(root / "dz", dtype=jnp.float32)
    return SimpleNamespace(main=main, mtp=mtp, extra=extra, config=config, weights=weights)


def test_the_module_is_kept(glm_mtp):
    c, m, e = glm_mtp.config, glm_mtp.weights.mtp[0], glm_mtp.extra
    assert c.family is Family.GLM4_MOE and c.attention is AttentionKind.GQA
    assert c.mtp_kept and c.mtp_layers == 1
    src = f"model.layers.{LAYERS}."
    np.testing.assert_array_equal(m.hnorm, e[src + "hnorm.weight"].numpy())
    np.testing.assert_array_equal(m.eh_proj, e[src + "eh_proj.weight"].numpy().T)
    assert m.layer.attn.q_bias is not None and m.layer.attn.q_norm is not None  # GLM's attention, not DeepSeek's


def test_module_logits_match_hf(glm_mtp):
    """HF's MtpModel over the main model's last hidden states (after its final norm): the same
    logits over a 64-token prompt."""
    assert_module_matches_hf(glm_mtp, "GLM MTP module")


@pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)
@pytest.mark.parametrize("kv_cache", ["none", pytest.param("int8", marks=pytest.mark.slow)])
def test_served_drafts_are_generates_and_lossless(glm_mtp, kv_cache, monkeypatch):
    """``Engine.generate`` and the paged server draft with the module (the server on a page pool
    of its own: per-head keys and values, gathered for the chain and turned to the contiguous
    cache's layout; with an int8 cache the scales turn with them): both give plain greedy
    output, and every served proposal equals ``generate``'s for the same request after the same
    number of tokens (a random module's drafts are rarely accepted, so the output alone could not
    show a wrong layout)."""
    from tests.test_serving_draft import _serve

    engine = Engine(glm_mtp.config, glm_mtp.weights, kv_cache=kv_cache, kernels="reference")
    prompts = _repetitive_prompts(glm_mtp.config.vocab_size)[:3]
    news = [10, 7, 9]
    spec = SpecConfig("mtp", num_draft_tokens=3)
    generated, served = [], []
    serve_propose, generate_propose = serving_mtp.MTPPool.propose, mtp_drafter.MTPDrafter.propose

    def recorded_serve(self, decoding, counts):
        drafts, counts_, q = serve_propose(self, decoding, counts)
        served.append(([r.id for r in decoding], [r.generated for r in decoding], counts.copy(), drafts.copy()))
        return drafts, counts_, q

    def recorded_generate(self, active, produced, k):
        drafts, q = generate_propose(self, active, produced, k)
        generated.append((produced.copy(), active.copy(), np.asarray(drafts).copy()))
        return drafts, q

    monkeypatch.setattr(serving_mtp.MTPPool, "propose", recorded_serve)
    monkeypatch.setattr(mtp_drafter.MTPDrafter, "propose", recorded_generate)
    plain = [c.token_ids for c in engine.generate(prompts, max_new_tokens=max(news), ignore_eos=True)]
    drafted = engine.generate(prompts, max_new_tokens=max(news), ignore_eos=True, speculative=spec)
    assert [c.token_ids for c in drafted] == plain and all(c.speculation.drafted > 0 for c in drafted)
    tight = ServingConfig(slots=2, page_size=8, max_context=64, num_pages=12, max_chunk=16, speculative=spec)
    fast, server = _serve(engine, tight, prompts, news)
    assert [f.token_ids for f in fast] == [p[:n] for p, n in zip(plain, news)]
    want = {(b, int(p[b])): d[b] for p, a, d in generated for b in range(len(prompts)) if a[b]}
    compared = 0
    for ids, steps, counts, drafts in served:
        for row, (i, g) in enumerate(zip(ids, steps)):
            n = int(counts[row])
            if n and (i, g) in want:
                assert drafts[row, :n].tolist() == want[i, g][:n].tolist(), (i, g)
                compared += 1
    assert compared >= 5 and server.stats.spec_drafted > 0, compared
