"""The Qwen multimodal checkpoints as whole models: config, conversion, check, planner count,
the vision tower's outputs and text-only logits, against HF transformers in fp32 (the oracle).

Two tiny random composite models go through the real converter: Qwen3.5-MoE
(``Qwen3_5MoeForConditionalGeneration``: Gated DeltaNet hybrid, no DeepStack) and Qwen3-VL-MoE
(``Qwen3VLMoeForConditionalGeneration``: Qwen3-MoE text model with a dense first layer, a tower
with DeepStack mergers). Their towers have 2x2 patch merging, two-frame patches and a position
grid both smaller and larger than the test images. Checked:

- the parsed config (tower, placeholder ids, M-RoPE sections) and the weight tree's parameter
  count, the planner's included, against HF's model;
- ``dayzero check`` passes on the HF directory and on the converted one; the tower is its own
  checkpoint group;
- the converted tower, through ``encode_images``, gives HF's merged embeddings and DeepStack
  features for two images of different grids;
- text-only logits over 50 tokens equal those of HF's composite model (whose text positions are
  the same on the three M-RoPE axes; HF's own rotary embedding is shown to be plain RoPE there,
  and not with distinct axes); under ``-m slow``, 32 greedy tokens through ``Engine.generate``;
- Qwen3-VL-MoE's published expert layout (input-major, which transformers transposes on load)
  converts to the same leaves as the layout ``save_pretrained`` writes; the published
  Qwen3-VL-30B-A3B config parses to HF's parameter count.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dayzero.convert import load_checkpoint
from dayzero.convert.check import check
from dayzero.model.config import ConfigError, Family, ModelConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.quant import QuantConfig, QuantizedArray, WeightQuant
from dayzero.model.vision_qwen import encode_images
from dayzero.model.weights import abstract_weights, named_leaves, parameter_count
from tests import linear_helpers as L
from tests.hf_helpers import MIN_ROUTER_GAP, all_logits, hf_greedy, random_ids

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

# A tower of depth 2, width 32 over 2 heads of 16, patches of 2 x 4 x 4 pixels, a 4 x 4 position grid.
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
# Qwen3.5's text model of tests/linear_helpers.py, its heads of 16 half rotated (4 frequencies, so
# that the M-RoPE sections below split them among the three axes).
QWEN35_TEXT = {**L.QWEN_TEXT, **L.QWEN_MOE, "head_dim": 16, "partial_rotary_factor": 0.5,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
# Qwen3-VL-MoE: layer 0 dense, layer 1 sparse (4 experts of 12, top 2), 8 frequencies per head.
QWEN3VL_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=64, intermediate_size=40, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
                    mlp_only_layers=[0], max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                     "mrope_interleaved": True})
GRIDS = [(1, 4, 6), (1, 6, 8)]  # two images, each of its own grid (in patches)
PROMPT = 50
# fp32 rounding: the tower ~1e-6 relative, the logits ~1e-6 (measured, see the report in the tests).
VISION_TOL, LOGITS_TOL = 1e-5, 1e-5


def _randomise(model, seed: int, centred: str | None = None):
    """Every parameter drawn at a scale that keeps activations O(1): projections N(0, 1/fan_in),
    embeddings and the position table N(0, 1), norm weights N(1, 0.2) (N(0, 0.2) in modules of
    class ``centred``, whose scale is 1 + w), biases N(0, 0.1), A_log over decay rates 0.01 .. 3."""
    gen = torch.Generator().manual_seed(seed)
    zero = {n for n, m in model.named_modules() if type(m).__name__ == centred}
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            owner = name.rsplit(".", 1)[0]
            if name.endswith("A_log"):
                p.copy_(math.log(0.01) + (math.log(3.0) - math.log(0.01)) * torch.rand(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight") and p.ndim == 1:
                p.copy_((0.0 if owner in zero else 1.0) + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif name.endswith(("embed_tokens.weight", "pos_embed.weight")):
                p.copy_(noise)
            else:  # Linear [out, in], fused experts [E, out, in], Conv1d [C, 1, W], the patch Conv3d
                fan_in = p[0].numel() if p.ndim in (2, 5) else p.shape[-1]
                p.copy_(noise / fan_in ** 0.5)
    return model


def _hf_composite(cls, config, seed: int, centred: str | None = None):
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    return _randomise(model, seed, centred)


def _router_gap(model, ids: np.ndarray) -> float:
    """The smallest gap between the last chosen and the first unchosen router logit of any token
    in any MoE layer of HF's forward over ``ids`` (a tie would make the logits test rounding)."""
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out[0].float().numpy()))
             for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    try:
        with torch.no_grad():
            model(torch.from_numpy(ids.astype(np.int64)))
    finally:
        for h in hooks:
            h.remove()
    k = model.config.get_text_config().num_experts_per_tok
    return min(float(np.min(s[:, k - 1] - s[:, k])) for s in (np.sort(x, -1)[:, ::-1] for x in seen))


def _case(hf_factory, tmp_path_factory, name: str, model) -> SimpleNamespace:
    hf_dir, dz_dir = hf_factory.save_and_convert(model, tmp_path_factory.mktemp(name))
    config, weights = load_checkpoint(dz_dir, dtype=jnp.float32)
    return SimpleNamespace(name=name, hf=model, hf_dir=hf_dir, dz_dir=dz_dir, config=config, weights=weights)


def qwen35_case(hf_factory, tmp_path_factory, **top) -> SimpleNamespace:
    """The tiny random Qwen3.5-MoE composite, converted (``top``: extra top-level config keys)."""
    config = transformers.Qwen3_5MoeConfig(text_config=QWEN35_TEXT, vision_config=VISION, **top)
    model = _hf_composite(transformers.Qwen3_5MoeForConditionalGeneration, config, 3, "Qwen3_5MoeRMSNorm")
    return _case(hf_factory, tmp_path_factory, "qwen3_5_moe", model)


def qwen3vl_case(hf_factory, tmp_path_factory, **top) -> SimpleNamespace:
    """The tiny random Qwen3-VL-MoE composite (DeepStack after layers 0 and 1), converted."""
    config = transformers.Qwen3VLMoeConfig(text_config=QWEN3VL_TEXT, vision_config={
        **VISION, "deepstack_visual_indexes": [0, 1]}, **top)
    model = _hf_composite(transformers.Qwen3VLMoeForConditionalGeneration, config, 5)
    return _case(hf_factory, tmp_path_factory, "qwen3_vl_moe", model)


@pytest.fixture(scope="module")
def qwen35(hf_factory, tmp_path_factory):
    return qwen35_case(hf_factory, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3vl(hf_factory, tmp_path_factory):
    return qwen3vl_case(hf_factory, tmp_path_factory)


@pytest.fixture(params=["qwen35", "qwen3vl"])
def case(request):
    return request.getfixturevalue(request.param)


def _hf_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_config_and_parameter_count(case):
    """The tower, its placeholder ids and the M-RoPE sections reach the config (and its JSON);
    the weight tree, and so the planner, counts HF's parameters, the tower's included."""
    c, hf = case.config, case.hf.config
    vc = c.vision
    assert (vc.depth, vc.hidden_size, vc.num_heads, vc.patch_dim, vc.out_hidden_size) == (2, 32, 2, 96, 32)
    assert vc.deepstack_indexes == ((0, 1) if case.name == "qwen3_vl_moe" else ())
    assert (vc.image_token_id, vc.video_token_id, vc.vision_start_token_id, vc.vision_end_token_id) == (
        hf.image_token_id, hf.video_token_id, hf.vision_start_token_id, hf.vision_end_token_id)
    assert c.family is (Family.QWEN3_MOE if case.name == "qwen3_vl_moe" else Family.QWEN3_5_MOE)
    assert c.rope.mrope_section == tuple(hf.text_config.rope_parameters["mrope_section"]) and c.rope.mrope_interleaved
    assert ModelConfig.from_json(c.to_json()) == c
    assert parameter_count(abstract_weights(c)) == DecodeFootprint(c).parameters == _hf_count(case.hf)
    assert parameter_count(case.weights.vision) == _hf_count(case.hf.model.visual)


def test_check_passes_and_the_tower_is_its_own_group(case):
    """``dayzero check`` finds every tensor of the HF directory expected (the tower's too) and
    every stored tensor of the converted one matching its manifest."""
    source = check(case.hf_dir)
    assert source.passed, source.all_problems
    assert not source.structure["ignored"] and source.structure["expected"] == source.structure["present"]
    converted = check(case.dz_dir)
    assert converted.passed, converted.all_problems
    assert converted.structure["tensors_verified"] == len(named_leaves(case.weights))
    assert (case.dz_dir / "weights" / "vision" / "_CHECKPOINT_METADATA").is_file()


def test_vision_tower_outputs_are_hfs(case):
    """Two images of different grids (one smaller, one larger than the position grid) through the
    converted tower: HF's merged embeddings and DeepStack features."""
    c = case.config.vision
    pixels = np.random.default_rng(0).standard_normal((sum(t * h * w for t, h, w in GRIDS), c.patch_dim),
                                                      dtype=np.float32)
    with torch.no_grad():
        out = case.hf.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(GRIDS))
    merged, deepstack = encode_images(case.weights.vision, c, pixels, GRIDS)
    ref_ds = getattr(out, "deepstack_features", None) or []
    assert len(deepstack) == len(ref_ds) == len(c.deepstack_indexes)
    for ours, ref in zip([merged, *deepstack], [out.pooler_output, *ref_ds]):
        ref = ref.numpy()
        assert ours.shape == ref.shape
        assert np.abs(np.asarray(ours) - ref).max() <= VISION_TOL * np.abs(ref).max()


def test_text_only_logits_are_hfs(case):
    """50 text tokens: our logits are those of HF's composite model (text positions equal on the
    three M-RoPE axes), with no router near a tie."""
    ids = random_ids(PROMPT, case.config.vocab_size, seed=7)
    if case.config.moe is not None:
        assert _router_gap(case.hf, ids) > MIN_ROUTER_GAP
    with torch.no_grad():
        ref = case.hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    ours = all_logits(case.weights, case.config, ids)
    scale = np.abs(ref).max()
    assert scale > 0.5
    assert np.abs(ours - ref).max() <= LOGITS_TOL * scale


@pytest.mark.slow
def test_greedy_generation_is_hfs(case):
    """32 greedy tokens of ``Engine.generate`` after a text prompt are HF generate's (its own
    cache, and M-RoPE decode positions equal on the three axes)."""
    from dayzero.engine import Engine

    prompt = random_ids(20, case.config.vocab_size, seed=3)
    out = Engine(case.config, case.weights).generate(prompt[0].tolist(), max_new_tokens=32, ignore_eos=True)
    assert out.token_ids == hf_greedy(case.hf, prompt, 32)


def test_text_positions_make_mrope_plain_rope(case):
    """HF's multi-axis rotary embedding with one position on all three axes is plain RoPE over
    the same frequencies (what dayzero computes for text); with distinct axes it is not."""
    rotary = case.hf.model.language_model.rotary_emb
    T = 12
    pos = torch.arange(T)[None, None].expand(3, 1, T)
    x = torch.zeros(1, T, 1)
    cos, sin = rotary(x, pos)
    angles = torch.arange(T)[:, None].float() * rotary.inv_freq[None]
    plain = torch.cat([angles, angles], -1)[None]
    torch.testing.assert_close(cos, plain.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, plain.sin(), rtol=0, atol=1e-6)
    other, _ = rotary(x, torch.stack([pos[0], pos[1] * 2, pos[2] * 3]))
    assert (other - cos).abs().max() > 0.1


def test_published_expert_layout_converts_alike(qwen3vl, tmp_path):
    """Qwen3-VL-MoE's published files keep the experts input-major (gate_up_proj [E, D, 2F],
    down_proj [E, F, D]; transformers transposes them on load): the same leaves as the layout
    ``save_pretrained`` writes, and ``check`` picks that layout too."""
    from dayzero.convert import convert_checkpoint

    tensors = load_file(qwen3vl.hf_dir / "model.safetensors")
    experts = [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    for name in experts:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    published = tmp_path / "hf"
    published.mkdir()
    for f in qwen3vl.hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (published / f.name).write_bytes(f.read_bytes())
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    assert check(published).passed
    convert_checkpoint(published, tmp_path / "dz", progress=False)
    _, weights = load_checkpoint(tmp_path / "dz", dtype=jnp.float32)
    ours, theirs = named_leaves(weights), named_leaves(qwen3vl.weights)
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name]), err_msg=name)


# Qwen/Qwen3-VL-30B-A3B-Instruct's config.json, the keys a third-party port transcribed from the
# hub file (its commit 1fc78ad); the rest of the file is bookkeeping (dtype, transformers_version...).
QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000, "vocab_size": 151936,
    },
    "tie_word_embeddings": False, "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_vl_moe", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653, "vision_start_token_id": 151652,
}


def test_published_qwen3_vl_config():
    """Qwen3-VL-30B-A3B: Qwen3-MoE's layers (renormalised top-8 of 128) with M-RoPE [24, 20, 20],
    a DeepStack tower; the weight tree counts the parameters of HF's model (meta device)."""
    c = parse_hf_config(copy.deepcopy(QWEN3_VL_30B_A3B))
    assert c.family is Family.QWEN3_MOE and c.moe.renormalize and all(c.moe.layers) and c.qk_norm
    assert (c.rope.theta, c.rope.mrope_section, c.head_dim) == (5e6, (24, 20, 20), 128)
    assert c.vision.deepstack_indexes == (8, 16, 24) and c.vision.image_token_id == 151655
    with torch.device("meta"):
        hf = transformers.Qwen3VLMoeForConditionalGeneration(
            transformers.Qwen3VLMoeConfig.from_dict(copy.deepcopy(QWEN3_VL_30B_A3B)))
    assert parameter_count(abstract_weights(c)) == _hf_count(hf)
    assert abs(_hf_count(hf) / 31.1e9 - 1) < 0.01  # the published "31B": 30.5B text, a 0.54B tower


def _edit(path: tuple[str, ...], value):
    raw = copy.deepcopy(QWEN3_VL_30B_A3B)
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return raw


@pytest.mark.parametrize("path, value, match", [
    (("text_config", "norm_topk_prob"), False, "norm_topk_prob"),
    (("text_config", "use_sliding_window"), True, "use_sliding_window"),
    (("text_config", "rope_scaling", "mrope_interleaved"), False, "mrope_interleaved"),
    (("text_config", "rope_scaling", "mrope_section"), [24, 20], "mrope_section"),
    (("text_config", "some_new_key"), 1, "text_config: .*some_new_key"),
    (("some_new_key",), 1, "some_new_key"),
    (("vision_config", "out_hidden_size"), 4096, "out_hidden_size=4096"),
    (("text_config", "model_type"), "qwen3_moe", "qwen3_vl_moe_text"),
])
def test_qwen3_vl_refusals(path, value, match):
    """What HF's Qwen3-VL classes would compute otherwise is one error naming the key."""
    with pytest.raises(ConfigError, match=match):
        parse_hf_config(_edit(path, value))


def test_mrope_keys_are_refused_outside_the_multimodal_qwens():
    """A text-only family never reads M-RoPE keys: there they are unknown RoPE parameters."""
    raw = {**L.qwen_next_config().to_dict()}
    parse_hf_config(raw)
    raw["rope_parameters"] = {**raw["rope_parameters"], "mrope_section": [1, 1, 2]}
    with pytest.raises(ConfigError, match="mrope_section"):
        parse_hf_config(raw)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8-block", "int4"])
def test_weight_quantization_leaves_the_tower_float(case, scheme):
    """Every weight scheme quantizes the text model's projections and none of the tower's."""
    specs = abstract_weights(case.config, QuantConfig(WeightQuant(scheme)))
    leaves = lambda tree: jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedArray))  # noqa: E731
    assert any(isinstance(x, QuantizedArray) for x in leaves(specs.layers))
    assert not any(isinstance(x, QuantizedArray) for x in leaves(specs.vision))


@pytest.mark.slow  # the reference load and two runs, ~8 s here
def test_verify_runs_the_composite_reference(case):
    """``dayzero verify`` on a composite checkpoint: HF loads it as an image-text-to-text model
    where it has no causal-LM class (Qwen3-VL-MoE), and every layer agrees on text."""
    from dayzero.tools.verify import verify

    report = verify(case.hf_dir, case.dz_dir, ids=random_ids(40, case.config.vocab_size, seed=4)[0].tolist())
    assert report.passed, report.failures
