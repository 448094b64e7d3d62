"""``dayzero check``: a good checkpoint passes; each kind of damage fails with the file or tensor named."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from dayzero.convert import convert_checkpoint
from dayzero.convert.checkpoint import file_sha256
from dayzero.engine.cli import main

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.1,
              tie_word_embeddings=False)
VICTIM = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


@pytest.fixture(scope="module")
def good(model, tmp_path_factory):
    """A saved tiny HF checkpoint (single safetensors file); tests damage copies of it."""
    path = tmp_path_factory.mktemp("check") / "hf"
    model.save_pretrained(path)
    return path


@pytest.fixture()
def copy(good, tmp_path):
    return shutil.copytree(good, tmp_path / "hf")


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["check", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def edit_tensors(directory, change) -> None:
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_good_checkpoint_passes(good, capsys):
    code, out, err = run(capsys, good)
    assert code == 0, out + err
    assert "OK    model.safetensors" in out and "21 expected, 21 present" in out
    assert out.splitlines()[-1].endswith(": OK")


def test_json_report(good, capsys):
    code, out, _ = run(capsys, good, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["problems"] == []
    files = {f["name"]: f for f in report["files"]}
    assert files["model.safetensors"]["sha256"] == file_sha256(good / "model.safetensors")
    assert files["model.safetensors"]["tensors"] == 21 and files["config.json"]["tensors"] is None
    assert report["total_bytes"] == sum(f["bytes"] for f in report["files"])


def test_sha256_list_match_and_mismatch(good, capsys, tmp_path):
    listing = tmp_path / "SHA256SUMS"
    names = ["config.json", "model.safetensors"]
    listing.write_text("".join(f"{file_sha256(good / n)}  {n}\n" for n in names))
    assert run(capsys, good, "--sha256-file", listing)[0] == 0
    listing.write_text(f"{file_sha256(good / 'config.json')}  config.json\n{'0' * 64} *model.safetensors\n")
    code, out, err = run(capsys, good, "--sha256-file", listing)
    assert code == 1 and "FAIL  model.safetensors" in out and "the list says " + "0" * 64 in out
    assert err.startswith("dayzero check: FAIL: model.safetensors: sha256")


def test_listed_file_missing_and_unlisted_weights(good, capsys, tmp_path):
    listing = tmp_path / "SHA256SUMS"
    listing.write_text(f"{file_sha256(good / 'config.json')}  config.json\n{'1' * 64}  model-00002.safetensors\n")
    code, out, _ = run(capsys, good, "--sha256-file", listing)
    assert code == 1
    assert "model-00002.safetensors is listed in" in out and "weight file has no sha256" in out


def test_truncated_safetensors(copy, capsys):
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[:-100])
    code, out, err = run(capsys, copy)
    assert code == 1 and "FAIL  model.safetensors" in out and "truncated or corrupt" in out
    assert "SKIP  structure" in out and "model.safetensors" in err


def test_nan_tensor(copy, capsys):
    def poison(t):
        t[VICTIM][3, 5] = np.nan
        t[VICTIM][0, 0] = np.inf
    edit_tensors(copy, poison)
    code, out, _ = run(capsys, copy)
    assert code == 1 and f"tensor '{VICTIM}' has 2 NaN/Inf values" in out


def test_missing_unexpected_and_wrong_shape_tensors(copy, capsys):
    def damage(t):
        del t[VICTIM]
        t["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
        t["model.norm.weight"] = np.ones((32,), np.float32)
    edit_tensors(copy, damage)
    code, out, _ = run(capsys, copy)
    assert code == 1
    assert f"missing tensor '{VICTIM}'" in out and "unexpected tensor 'model.layers.0.mlp.extra.weight'" in out
    assert "tensor 'model.norm.weight' has shape [32], expected [64]" in out


def test_sharded_and_torch_sources(model, capsys, tmp_path):
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert run(capsys, tmp_path / "sharded")[0] == 0
    torch.save(model.state_dict(), tmp_path / "sharded" / "weights.pt")
    code, out, err = run(capsys, tmp_path / "sharded" / "weights.pt")
    assert code == 0 and "OK    weights.pt" in out, out + err


def test_converted_checkpoint_and_its_manifest(good, capsys, tmp_path):
    dst = convert_checkpoint(good, tmp_path / "dz", progress=False)
    code, out, _ = run(capsys, dst)
    assert code == 0 and "21 stored tensors match" in out
    # The manifest's source hashes vouch for the source it was converted from.
    assert run(capsys, good, "--sha256-file", dst)[0] == 0


def write_gguf(path, model, poison: str | None = None):
    """A llama-arch GGUF of ``model`` (values not permuted: check reads shapes and finiteness only)."""
    c = model.config
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        tensors.update({f"blk.{i}.{ours}.weight": sd[f"model.layers.{i}.{hf}.weight"] for hf, ours in names.items()})
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, 512),
                       (w.add_embedding_length, 64), (w.add_feed_forward_length, 128), (w.add_head_count, 4),
                       (w.add_head_count_kv, 2), (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, 256)):
        add(value)
    for name, value in tensors.items():
        value = np.array(value, np.float32)
        if name == poison:
            value[0, 0] = np.nan
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf(model, capsys, tmp_path):
    code, out, err = run(capsys, write_gguf(tmp_path / "tiny.gguf", model))
    assert code == 0 and "llama, 2 layers" in out, out + err
    code, out, _ = run(capsys, write_gguf(tmp_path / "bad.gguf", model, poison="blk.1.ffn_up.weight"))
    assert code == 1 and "tensor 'blk.1.ffn_up.weight' has 1 NaN/Inf value" in out


def test_bad_inputs(good, capsys, tmp_path):
    code, _, err = run(capsys, tmp_path / "absent")
    assert code == 2 and err.startswith("dayzero: error:") and "absent does not exist" in err
    (tmp_path / "sums").write_text("not a hash line\n")
    code, _, err = run(capsys, good, "--sha256-file", tmp_path / "sums")
    assert code == 2 and "line 1 of" in err


def test_moe_checkpoint_passes_and_a_missing_expert_is_named(tmp_path, capsys):
    """Per-expert MoE tensors are read through the converter's layout choice, expert by expert."""
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = dict(CONFIG, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    path = tmp_path / "mixtral"
    MixtralForCausalLM(MixtralConfig(**moe)).eval().save_pretrained(path)
    code, out, err = run(capsys, path)
    assert code == 0, out + err
    victim = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    edit_tensors(path, lambda t: t.pop(victim))
    code, out, _ = run(capsys, path)
    assert code == 1 and f"missing tensor '{victim}'" in out
