"""GLM-4.5's multi-token-prediction module (``glm4_moe``, ``num_nextn_predict_layers``): kept by
the converter and run by the MTP drafter as DeepSeek-V3's is (tests/test_speculative_mtp.py),
over grouped-query attention with q/k/v biases, q/k norms and partial RoPE.

Oracle: HF transformers' generic ``MtpModel`` built on an HF Glm4Moe main model (as HF's own
``generate(use_mtp=True)`` builds it): the converted module's logits over a 64-token prompt are
its. Greedy speculative output through ``Engine.generate`` is the plain engine's; the paged
server refuses the module (its MTP pool is latent-attention only), in one line.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dayzero.convert import convert_checkpoint, load_checkpoint
from dayzero.engine import Engine, GenerationError, ServingConfig, ServingEngine
from dayzero.engine.speculative import SpecConfig
from dayzero.model.config import AttentionKind, Family
from tests.hf_helpers import assert_logits_match, copy_hf_checkpoint
from tests.test_glm4_moe import SEED, build_hf_glm
from tests.test_speculative import _repetitive_prompts
from tests.test_speculative_mtp import _module_logits

LAYERS = 2  # main layers of the HF model; its MTP module is stored as layer 2 (a MoE layer)


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory):
    """An HF Glm4Moe main model with a random MTP module (HF's ``MtpModel``), saved as GLM-4.5
    stores it (layer 2 with enorm/hnorm/eh_proj/shared_head, its decoder layer spelt as a main
    layer's, copies of the embedding and head), and converted."""
    from transformers.modeling_layers import MtpModel

    root = tmp_path_factory.mktemp("glm_mtp")
    big = build_hf_glm(SEED, num_hidden_layers=LAYERS + 1)  # its last layer becomes the module's
    big.save_pretrained(root / "big")
    main = type(big)(transformers.Glm4MoeConfig(**{**big.config.to_dict(), "num_hidden_layers": LAYERS})).eval()
    main.load_state_dict({k: v for k, v in big.state_dict().items() if f"layers.{LAYERS}." not in k})
    mtp = MtpModel(main, 1).eval()
    layer = mtp.layers[0]
    layer.mtp_block.load_state_dict(big.model.layers[LAYERS].state_dict())
    torch.manual_seed(7)
    with torch.no_grad():
        for p in (layer.enorm.weight, layer.hnorm.weight, layer.post_norm.weight):
            p.normal_(1.0, 0.1)
        layer.eh_proj.weight.normal_(0.0, 0.1)
    src = f"model.layers.{LAYERS}."
    extra = {src + "enorm.weight": layer.enorm.weight, src + "hnorm.weight": layer.hnorm.weight,
             src + "eh_proj.weight": layer.eh_proj.weight, src + "shared_head.norm.weight": layer.post_norm.weight,
             src + "shared_head.head.weight": main.lm_head.weight, src + "embed_tokens.weight": main.model.embed_tokens.weight}
    extra = {k: v.detach().clone().contiguous() for k, v in extra.items()}
    hf_dir = copy_hf_checkpoint(root / "big", root / "hf",
                                lambda raw: raw.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1),
                                lambda t: t.update(extra))
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
    c, w = glm_mtp.config, glm_mtp.weights
    ids = np.random.default_rng(3).integers(0, c.vocab_size, (1, 64))
    t = torch.from_numpy(ids)
    with torch.no_grad():
        h = glm_mtp.main(t, output_hidden_states=True).hidden_states[-1]
        x = glm_mtp.mtp.forward_layer(0, h[:, :-1], torch.arange(1, 64)[None], None, input_ids=t[:, 1:])
        ref = glm_mtp.mtp._project_to_logits(x).numpy()
    assert_logits_match(np.asarray(_module_logits(w, c, jnp.asarray(ids, jnp.int32))), ref, "GLM MTP module")


def test_greedy_is_lossless_and_serving_refuses(glm_mtp):
    """The converted (random) module drafts through ``Engine.generate``: the output is plain
    greedy output. The paged server's MTP pool is built for latent attention: refused, in one line."""
    engine = Engine(glm_mtp.config, glm_mtp.weights, kernels="reference")
    prompts = _repetitive_prompts(glm_mtp.config.vocab_size)[:2]
    plain = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
    fast = engine.generate(prompts, max_new_tokens=8, ignore_eos=True, speculative=SpecConfig("mtp", num_draft_tokens=3))
    assert [f.token_ids for f in fast] == [p.token_ids for p in plain]
    assert all(f.speculation.drafted > 0 for f in fast)
    with pytest.raises(GenerationError, match="latent attention") as raised:
        ServingEngine(engine, ServingConfig(slots=2, page_size=8, max_context=64, speculative=SpecConfig("mtp")))
    assert "\n" not in str(raised.value)
