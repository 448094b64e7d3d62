"""Kimi-K2.5 as a whole checkpoint: the ``kimi_k25`` config, conversion, images through the
DeepSeek-V3 text model and ``Engine.generate(..., images=...)``, against HF transformers'
``Kimi_K25ForConditionalGeneration`` in fp32 (eager attention), the oracle.

A tiny random composite (a MoonViT tower of depth 2 with 4-pixel patches; a DeepSeek-V3 text
model of one dense and one MoE layer with latent attention, YaRN and a q LoRA) is saved by HF and
goes through the real converter. Its special tokens sit inside the 128-token vocabulary. Images
are made with Pillow and go through the engine's preprocessing (equal to HF's processor:
tests/test_images.py); HF gets the same pixel values, grids and expanded prompt. Checked:

- the config: HF's spelling and Moonshot's (``media_placeholder_token_id``, a ``kimi_k2`` text
  config, ``vt_*`` tower keys) parse alike, strictly; the placeholder id reaches
  ``config.vision.image_token_id``; the weight tree counts HF's parameters;
- conversion: ``save_pretrained``'s names (text layers written back as ``blocks``), Moonshot's
  published names and HF's module names give the same leaves; ``dayzero check`` and ``verify``;
- logits over a prompt with one and with two images equal HF's; without the image embeddings, or
  with M-RoPE-style positions (images compressed to fewer positions), they do not (Kimi's images
  take plain 1-D positions, one per placeholder);
- ``Engine.generate`` with one and with two images: HF generate's 32 greedy tokens and their
  log-probabilities (prefill, then decode steps); a text-only prompt likewise; the refusals.

HF zeroes every placeholder id before its embedding lookup, so a *generated* placeholder would be
embedded as token 0 there and as itself here: the greedy runs assert HF generates none.

Default: ~30 s on 2 cores (most of it the fixture and the compiles).
Under -m slow (~95 s): generate with two images and text-only, ``verify``, chunked + batched.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.numpy import load_file, save_file

from dayzero.convert import convert_checkpoint, load_checkpoint
from dayzero.convert.check import check
from dayzero.engine import generate as gen
from dayzero.engine import vision_step
from dayzero.engine.generate import Engine, GenerationError
from dayzero.engine.image_processing import KimiImageConfig, batch_pixels
from dayzero.model.config import ConfigError, Family, ModelConfig
from dayzero.model.footprint import DecodeFootprint
from dayzero.model.hf_config import parse_hf_config
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig
from dayzero.model.mrope import ImageInput, rope_index
from dayzero.model.weights import abstract_weights, parameter_count
from tests.hf_helpers import MIN_ROUTER_GAP, assert_same_weights, forward_jit
from tests.test_deepseek import EXPERTS, N_GROUP, TOP_K, TOPK_GROUP, routing_gaps
from tests.test_vision_convert import _randomise

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48, patch_size=4,
              pos_emb_height=6, pos_emb_width=6, pos_emb_time=4)
TEXT = dict(model_type="deepseek_v3", vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=N_GROUP, topk_group=TOPK_GROUP,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                                 mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0),
            bos_token_id=None, eos_token_id=None, pad_token_id=None, num_nextn_predict_layers=0)
# Special tokens inside the vocabulary (HF's defaults are past it); text is drawn below them.
TOKENS = dict(image_token_id=127, vision_start_token_id=125, vision_end_token_id=126, video_token_id=124)
TEXT_VOCAB = 124
IMAGE = TOKENS["image_token_id"]
# 40 x 28 pixels: 4-pixel patches, padded to 40 x 32, a (1, 8, 10) grid, 20 tokens; 24 x 20: (1, 6, 6), 9 tokens.
SIZES = [(40, 28), (24, 20)]
NEW = 32
LOGITS_TOL = 1e-5  # relative to the largest |HF logit|; measured 1.3e-6 (fp32 rounding)
LOGPROB_TOL = 1e-4  # fp32 on both sides


def _image(k: int) -> Image.Image:
    w, h = SIZES[k]
    return Image.fromarray(np.random.default_rng(k).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(n_images: int, seed: int = 1) -> list[int]:
    """Text, then per image the chat template's (start, one placeholder, end) and more text."""
    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, TEXT_VOCAB, 5)]
    for _ in range(n_images):
        ids += [TOKENS["vision_start_token_id"], IMAGE, TOKENS["vision_end_token_id"]]
        ids += [int(i) for i in rng.integers(0, TEXT_VOCAB, 4)]
    return ids


def _build_hf():
    config = transformers.Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
                                         projection_layer_norm_eps=1e-3, tie_word_embeddings=False, **TOKENS)
    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration._from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    _randomise(model, 0)
    with torch.no_grad():  # DeepSeek's expert-choice biases (buffers), random as in tests/test_deepseek.py
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k25")
    model = _build_hf()
    model.save_pretrained(root / "hf")
    convert_checkpoint(root / "hf", root / "dz", progress=False)
    config, weights = load_checkpoint(root / "dz", dtype=jnp.float32)
    return SimpleNamespace(hf=model, root=root, hf_dir=root / "hf", dz_dir=root / "dz", config=config,
                           weights=weights, engine=Engine(config, weights, kernels="reference"))


def _processed(config, n_images: int):
    return vision_step.preprocess([_image(k) for k in range(n_images)], vision_step.image_config_of(config))


def _hf_inputs(config, ids: list[int], n_images: int) -> dict:
    """HF's inputs: our pixels and grids (its processor's) and the prompt with each placeholder
    expanded as its processor does (t*h*w / merge^2 copies)."""
    if not n_images:
        return dict(input_ids=torch.tensor([ids]))
    pixels, grids = batch_pixels(_processed(config, n_images))
    counts = iter(int(np.prod(g)) // 4 for g in grids)
    expanded = [j for i in ids for j in ([i] * next(counts) if i == IMAGE else [i])]
    return dict(input_ids=torch.tensor([expanded]), pixel_values=torch.from_numpy(pixels),
                image_grid_thw=torch.from_numpy(grids))


def _min_router_gap(model, inputs: dict) -> float:
    """The smallest group-cut and expert-cut gap of any token in HF's MoE layer over ``inputs``."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, _i, out: seen.append((out[0].numpy(),
                                                                       mod.e_score_correction_bias.numpy())))
             for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    assert seen
    return min(min(routing_gaps(logits, bias)) for logits, bias in seen)


def _hf_greedy(case, ids: list[int], n_images: int) -> tuple[list[int], np.ndarray]:
    """HF generate's greedy tokens and their log-probabilities. HF embeds a generated placeholder
    id as token 0 (it zeroes every placeholder before the lookup): none may be generated here."""
    inputs = _hf_inputs(case.config, ids, n_images)
    x = inputs["input_ids"]
    with torch.no_grad():
        out = case.hf.generate(**inputs, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, x.shape[1]:].tolist()
    assert IMAGE not in tokens
    whole = dict(inputs, input_ids=out.sequences[:, :-1])
    assert _min_router_gap(case.hf, whole) > MIN_ROUTER_GAP  # no routing choice near a tie
    logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, np.asarray(logprobs)


def _assert_hfs(out, ref) -> None:
    """The tokens, and (sensitive to every position) their log-probabilities, are HF's."""
    assert out.token_ids == ref[0]
    np.testing.assert_allclose(out.logprobs, ref[1], rtol=0, atol=LOGPROB_TOL)


# ---- config and conversion -------------------------------------------------------------------------


def test_config_and_parameter_count(kimi):
    """HF's file: the DeepSeek-V3 text model, the tower with the placeholder id, untied as the file
    says; the JSON round trip; HF's parameter count, the tower's included, in the weight tree
    and the planner."""
    c = kimi.config
    assert c.family is Family.DEEPSEEK_V3 and c.mla is not None and not c.tie_word_embeddings
    assert isinstance(c.vision, KimiVisionConfig) and not c.rope.mrope_section
    assert (c.vision.image_token_id, c.vision.depth, c.vision.out_hidden_size, c.vision.projector_eps) == \
        (IMAGE, 2, 64, 1e-3)
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c
    # HF keeps DeepSeek's expert-choice biases as buffers, not parameters.
    biases = sum(b.numel() for n, b in kimi.hf.named_buffers() if n.endswith("e_score_correction_bias"))
    hf_count = sum(p.numel() for p in kimi.hf.parameters()) + biases
    assert parameter_count(abstract_weights(c)) == DecodeFootprint(c).parameters == hf_count


def _moonshot_config(hf_raw: dict) -> dict:
    """The same model as Moonshot's config.json spells it (the published file's keys)."""
    raw = copy.deepcopy(hf_raw)
    v = raw["vision_config"]
    for ours, theirs in (("hidden_size", "vt_hidden_size"), ("num_hidden_layers", "vt_num_hidden_layers"),
                         ("num_attention_heads", "vt_num_attention_heads"), ("intermediate_size", "vt_intermediate_size"),
                         ("pos_emb_height", "init_pos_emb_height"), ("pos_emb_width", "init_pos_emb_width"),
                         ("pos_emb_time", "init_pos_emb_time")):
        v[theirs] = v.pop(ours)
    v.update(model_type="", mm_hidden_size=v["vt_hidden_size"], projector_ln_eps=raw.pop("projection_layer_norm_eps"),
             text_hidden_size=raw["text_config"]["hidden_size"], merge_type="sd2_tpool", pos_emb_type="divided_fixed",
             video_attn_type="spatial_temporal", mm_projector_type="patchmerger", projector_hidden_act="gelu")
    del raw["projection_hidden_size"], raw["image_token_id"]
    raw["text_config"]["model_type"] = "kimi_k2"
    raw.update(media_placeholder_token_id=IMAGE, use_unified_vision_chunk=True, ignore_index=-100,
               video_placeholder="<|kimi_k25_video_placeholder|>", architectures=["KimiK25ForConditionalGeneration"])
    return raw


def test_config_spellings_and_errors(kimi):
    """Moonshot's spelling parses to the same config; the placeholder defaults to 163605; the
    embeddings are tied where the file does not say (HF's Kimi_K25Config default); a clash of
    the two placeholder spellings, an unknown key or a foreign text model is one ConfigError."""
    raw = json.loads((kimi.hf_dir / "config.json").read_text())
    assert parse_hf_config(_moonshot_config(raw)) == kimi.config
    bare = {k: v for k, v in raw.items() if k not in ("image_token_id", "tie_word_embeddings")}
    c = parse_hf_config(bare)
    assert c.vision.image_token_id == 163605 and c.tie_word_embeddings
    for bad, match in [({"media_placeholder_token_id": 5}, "media_placeholder_token_id=5, image_token_id=127 disagree"),
                       ({"mm_tokens_per_image": 4}, "mm_tokens_per_image"),
                       ({"text_config": {**raw["text_config"], "model_type": "qwen3"}}, "text_config model_type='qwen3'")]:
        with pytest.raises(ConfigError, match=match):
            parse_hf_config({**raw, **bad})


def _respelled(case, name: str, rename, tensors: dict | None = None):
    """The saved checkpoint with every tensor renamed by ``rename`` (or ``tensors`` instead),
    converted: its weights."""
    src, dst = case.root / f"{name}_hf", case.root / f"{name}_dz"
    src.mkdir()
    (src / "config.json").write_text((case.hf_dir / "config.json").read_text())
    if tensors is None:
        tensors = {rename(k): v for k, v in load_file(case.hf_dir / "model.safetensors").items()}
    save_file(tensors, src / "model.safetensors")
    convert_checkpoint(src, dst, progress=False)
    return load_checkpoint(dst, dtype=jnp.float32)[1]


def _moonshot_name(name: str) -> str:
    """A ``save_pretrained`` name as Moonshot's published files spell it."""
    for saved, published in (("language_model.model.blocks.", "language_model.model.layers."),
                             ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
                             ("model.mm_projector.", "mm_projector.")):
        if name.startswith(saved):
            return published + name[len(saved):]
    return name


def test_published_and_module_spellings_convert_alike(kimi):
    """Moonshot's published names, and HF's own module names (the state dict of the loaded model,
    experts fused), convert to exactly the leaves of ``save_pretrained``'s file."""
    saved = load_file(kimi.hf_dir / "model.safetensors")
    assert any(".model.blocks.1.mlp.experts.0." in k for k in saved)  # HF's reverse rename, as the map expects
    assert_same_weights(_respelled(kimi, "moonshot", _moonshot_name), kimi.weights)
    modules = {k: v.numpy() for k, v in kimi.hf.state_dict().items()}
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" in modules
    assert_same_weights(_respelled(kimi, "modules", None, modules), kimi.weights)


def test_check(kimi):
    """``dayzero check`` expects every tensor of HF's directory (the tower's too) and finds the
    converted one matching its manifest."""
    source = check(kimi.hf_dir)
    assert source.passed, source.all_problems
    assert not source.structure["ignored"] and source.structure["expected"] == source.structure["present"]
    assert check(kimi.dz_dir).passed


@pytest.mark.slow
def test_verify(kimi):
    """``dayzero verify`` (text through HF's composite model, layer by layer) passes."""
    from dayzero.tools.verify import verify

    report = verify(kimi.hf_dir, kimi.dz_dir, ids=_prompt(0, seed=3) * 4)
    assert report.passed, report.failures


# ---- images through the text model -------------------------------------------------------------------


def _ours(case, ids: list[int], images: ImageInput | None) -> np.ndarray:
    logits, _ = forward_jit(case.weights, case.config, jnp.asarray([ids], jnp.int32), None, all_logits=True,
                            images=images)
    return np.asarray(logits)


def _error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_are_hfs(kimi, n_images):
    """Logits over a prompt with one image / two images of different grids: HF's, the image
    embeddings written over the placeholders before layer 0, at plain positions. Without the
    embeddings, or at the positions M-RoPE would give, they are far from HF's."""
    c = kimi.config
    inputs = _hf_inputs(c, _prompt(n_images), n_images)
    assert _min_router_gap(kimi.hf, inputs) > MIN_ROUTER_GAP
    with torch.no_grad():
        ref = kimi.hf(**inputs).logits.numpy()
    ids = inputs["input_ids"][0].tolist()
    done = _processed(c, n_images)
    grids = [im.grid_thw for im in done]
    embeds, deepstack = vision_step.encode(kimi.weights, c, done)
    assert embeds.shape == (sum(im.num_tokens for im in done), c.hidden_size) and deepstack == []
    prefill = vision_step.ImagePrefill.build(c, [ids], np.array([len(ids)]), grids, embeds, deepstack)
    assert not prefill.deltas.any()
    images = prefill.chunk(0, len(ids))
    assert _error(_ours(kimi, ids, images), ref) < LOGITS_TOL
    assert _error(_ours(kimi, ids, images.replace(embeds=jnp.zeros_like(images.embeds))), ref) > 100 * LOGITS_TOL
    # M-RoPE's positions (an image's tokens share the temporal axis position forward reads) break it.
    vl = SimpleNamespace(image_token_id=IMAGE, spatial_merge_size=2)
    mrope, _ = rope_index(vl, np.asarray([ids]), grids)
    assert _error(_ours(kimi, ids, images.replace(position_ids=jnp.asarray(mrope))), ref) > 100 * LOGITS_TOL


def test_text_logits_are_hfs(kimi):
    """A text-only prompt through the composite model: HF's logits (no ImageInput at all)."""
    ids = _prompt(0, seed=4) * 6
    with torch.no_grad():
        ref = kimi.hf(input_ids=torch.tensor([ids])).logits.numpy()
    assert _error(_ours(kimi, ids, None), ref) < LOGITS_TOL


# ---- Engine.generate ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_images", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_generate_with_images_is_hfs(kimi, n_images):
    """The converted checkpoint through ``Engine.generate(images=...)``: HF generate's 32 greedy
    tokens and their log-probabilities; the prompt ids come back expanded."""
    prompt = _prompt(n_images)
    ref = _hf_greedy(kimi, prompt, n_images)
    out = kimi.engine.generate(prompt, images=[_image(k) for k in range(n_images)], max_new_tokens=NEW,
                               ignore_eos=True, logprobs=True)
    _assert_hfs(out, ref)
    assert out.prompt_ids.count(IMAGE) == [20, 29][n_images - 1]
    assert vision_step.image_config_of(kimi.config) == KimiImageConfig(patch_size=4, merge_size=2)


@pytest.mark.slow  # text-only logits are checked by default (test_text_logits_are_hfs)
def test_generate_text_only_is_hfs(kimi):
    """A text-only prompt on the vision model: HF's tokens and log-probabilities."""
    prompt = _prompt(0, seed=7)
    out = kimi.engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    _assert_hfs(out, _hf_greedy(kimi, prompt, 0))


def test_refusals(kimi):
    """One-line GenerationErrors for a placeholder count that is not the image count."""
    engine = Engine(kimi.config, kimi.weights, kernels="reference")
    with pytest.raises(GenerationError, match="2 image placeholders .* for 1 images"):
        engine.generate(_prompt(2), images=[_image(0)], max_new_tokens=2)
    with pytest.raises(GenerationError, match="0 image placeholders .* for 1 images"):
        engine.generate(_prompt(0), images=[_image(0)], max_new_tokens=2)
    assert not engine._steps.signatures()


@pytest.mark.slow
def test_generate_chunked_and_batched(kimi, monkeypatch):
    """Prefill chunks of 16 tokens (the images' 29 tokens over three chunks), and a batch of the
    two-image prompt beside a text prompt: each row HF's alone."""
    monkeypatch.setattr(gen, "PREFILL_CHUNK", 16)
    engine = Engine(kimi.config, kimi.weights, kernels="reference")
    with_images, text = _prompt(2), _prompt(0, seed=6)
    outs = engine.generate([with_images, text], images=[[_image(0), _image(1)], []], max_new_tokens=NEW,
                           ignore_eos=True, logprobs=True)
    _assert_hfs(outs[0], _hf_greedy(kimi, with_images, 2))
    _assert_hfs(outs[1], _hf_greedy(kimi, text, 0))
