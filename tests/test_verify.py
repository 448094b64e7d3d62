"""``dayzero verify``: a faithful conversion passes, a planted fault is found at its layer.

A tiny random Llama (4 layers, initializer_range 0.1 so activations and logits are O(1)) is saved
and converted. For the fault, a copy of the saved source gets noise added to layer 2's
``mlp.down_proj.weight`` before it is converted; verifying that conversion against the untouched
original must fail and point at layer 2, with layers 0 and 1 still within tolerance.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dayzero.convert import convert_checkpoint
from dayzero.engine.cli import main
from dayzero.engine.tokenizer import Tokenizer
from dayzero.tools.verify import DEFAULT_PROMPT, Tolerance, compare

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.1)
PROMPT_IDS = ",".join(str(i) for i in np.random.default_rng(0).integers(0, 256, size=96))
FAULT = "model.layers.2.mlp.down_proj.weight"


def word_tokenizer(directory) -> None:
    """A word-level tokenizer.json covering the default prompt's words (ids well inside 256)."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = pre_tokenizers.Whitespace().pre_tokenize_str(DEFAULT_PROMPT)
    vocab = {"[UNK]": 0}
    for word, _ in words:
        vocab.setdefault(word, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(hf, dz, dz_bad)``: the original, its conversion, and the conversion of a faulty copy."""
    root = tmp_path_factory.mktemp("verify")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():  # HF initialises norms to 1, which would hide a swapped norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(root / "hf")
    word_tokenizer(root / "hf")
    convert_checkpoint(root / "hf", root / "dz", progress=False)
    shutil.copytree(root / "hf", root / "hf_bad")
    tensors = load_file(root / "hf_bad" / "model.safetensors")
    tensors[FAULT] = tensors[FAULT] + np.random.default_rng(1).normal(0, 0.05, tensors[FAULT].shape).astype(np.float32)
    save_file(tensors, root / "hf_bad" / "model.safetensors", metadata={"format": "pt"})
    convert_checkpoint(root / "hf_bad", root / "dz_bad", progress=False)
    return root / "hf", root / "dz", root / "dz_bad"


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["verify", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_faithful_conversion_passes(models, capsys):
    hf, dz, _ = models
    code, out, err = run(capsys, "--model", dz, "--reference", hf, "--prompt-ids", PROMPT_IDS)
    assert code == 0, err
    assert "PASS" in out and "first bad layer: none" in out
    assert [line.split()[0] for line in out.splitlines()[2:6]] == ["0", "1", "2", "3"]


def test_planted_fault_names_layer_2(models, capsys):
    hf, _, dz_bad = models
    code, out, err = run(capsys, "--model", dz_bad, "--reference", hf, "--prompt-ids", PROMPT_IDS, "--json")
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "layer 2 (model.layers.2)" in err
    report = json.loads(out)
    assert set(report) >= {"layers", "logits", "first_bad_layer", "first_jump_layer", "passed", "failures"}
    assert report["passed"] is False and report["first_bad_layer"] == 2 and report["first_jump_layer"] == 2
    rows = report["layers"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"layer", "max_abs_err", "ref_max_abs", "rel_err", "within_tolerance", "growth", "jump"}
    assert [r["within_tolerance"] for r in rows] == [True, True, False, False]
    assert rows[0]["rel_err"] < 1e-5 and rows[1]["rel_err"] < 1e-5 and rows[2]["rel_err"] > 1e-2
    assert set(report["logits"]) >= {"max_abs_err", "kl_mean", "kl_max", "top1_agreement"}


def test_fault_table_and_loosened_tolerance(models, capsys):
    hf, _, dz_bad = models
    code, out, _ = run(capsys, "--model", dz_bad, "--reference", hf, "--prompt-ids", PROMPT_IDS)
    assert code == 1 and "first bad layer: 2 (model.layers.2)" in out
    # With bounds no fp32 port needs, the same fault is tolerated: the options reach the criteria.
    code, out, err = run(capsys, "--model", dz_bad, "--reference", hf, "--prompt-ids", PROMPT_IDS,
                         "--rtol", "10", "--max-kl", "10", "--min-top1", "0", "--json")
    assert code == 0 and json.loads(out)["passed"], err


def test_default_prompt_is_encoded_with_dst_tokenizer(models, capsys):
    hf, dz, _ = models
    code, out, err = run(capsys, "--model", dz, "--reference", hf, "--json")
    assert code == 0, err
    assert json.loads(out)["num_tokens"] == len(Tokenizer(dz).encode(DEFAULT_PROMPT)) > 150


def test_state_dict_reference(models, capsys, tmp_path):
    from safetensors.torch import load_file as load_torch

    hf, dz, _ = models
    shutil.copyfile(hf / "config.json", tmp_path / "config.json")
    torch.save(load_torch(hf / "model.safetensors"), tmp_path / "weights.pt")
    code, out, err = run(capsys, "--model", dz, "--reference", tmp_path / "weights.pt", "--prompt-ids", PROMPT_IDS)
    assert code == 0 and "PASS" in out, err


@pytest.mark.parametrize("case, needle", [
    ("missing_dst", "not a directory"),
    ("missing_src", "does not exist"),
    ("bad_id", "outside the vocabulary"),
    ("bad_ids", "comma-separated"),
    ("bad_rtol", "--rtol"),
])
def test_bad_inputs_are_one_line_errors(models, capsys, tmp_path, case, needle):
    hf, dz, _ = models
    args = {
        "missing_dst": ["--model", tmp_path / "nope", "--reference", hf],
        "missing_src": ["--model", dz, "--reference", tmp_path / "gone"],
        "bad_id": ["--model", dz, "--reference", hf, "--prompt-ids", "1,999"],
        "bad_ids": ["--model", dz, "--reference", hf, "--prompt-ids", "1,x"],
        "bad_rtol": ["--model", dz, "--reference", hf, "--rtol", "-1"],
    }[case]
    code, _, err = run(capsys, *args)
    assert code == 2
    assert err.startswith("dayzero: error:") and needle in err and len(err.strip().splitlines()) == 1


def test_first_jump_precedes_first_bad_for_an_amplified_fault():
    # A small fault at layer 1 (5e-5, under tolerance) amplified 10x per layer after it.
    ref = [np.ones((4, 8), np.float32) for _ in range(5)]
    rel = [1e-7, 5e-5, 5e-4, 5e-3, 5e-2]
    ours = [r + np.float32(e) for r, e in zip(ref, rel)]
    logits = np.zeros((4, 16), np.float32)
    report = compare(ref, logits, ours, logits, Tolerance())
    assert report.first_jump_layer == 1 and report.first_bad_layer == 3
    assert "first jumped at layer 1" in report.verdict()


def test_moe_model_passes_and_a_faulty_expert_is_found(tmp_path, capsys):
    """Verify works for MoE families too: a planted fault in one expert of layer 1 is named."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(3)
    model = MixtralForCausalLM(MixtralConfig(**CONFIG, num_local_experts=4, num_experts_per_tok=2)).eval()
    model.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "dz", progress=False)
    code, out, err = run(capsys, "--model", str(tmp_path / "dz"), "--reference", str(tmp_path / "hf"),
                         "--prompt-ids", PROMPT_IDS)
    assert code == 0, out + err
    bad = shutil.copytree(tmp_path / "hf", tmp_path / "hf_bad")
    tensors = load_file(bad / "model.safetensors")
    # Every expert of layer 1 is perturbed, so whichever experts the prompt routes to, layer 1 moves.
    for e in range(4):
        name = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
        tensors[name] = tensors[name] + np.random.default_rng(e).normal(0, 0.05, tensors[name].shape).astype(np.float32)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    convert_checkpoint(bad, tmp_path / "dz_bad", progress=False)
    code, out, _ = run(capsys, "--model", str(tmp_path / "dz_bad"), "--reference", str(tmp_path / "hf"),
                       "--prompt-ids", PROMPT_IDS, "--json")
    report = json.loads(out)
    assert code == 1 and report["first_bad_layer"] == 1
