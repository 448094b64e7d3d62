"""``dayzero generate --image``: images through the model's chat template and ``Engine.generate``.

The tiny random Qwen3-VL-MoE of tests/test_vision_dispatch.py (its image, video, vision start and
end tokens at 60-63), converted, gets a character-level tokenizer whose special tokens sit at
those ids and a Qwen-VL-style chat template (image parts -> ``<|vision_start|><|image_pad|>
<|vision_end|>``, as the published Qwen3-VL and Qwen3.5 templates write them). Checked:

- the chat rendering of a message with image parts is HF's ``apply_chat_template`` (the oracle),
  and its ids hold one placeholder per image between the vision start and end tokens;
- ``generate --image PNG --prompt TEXT --json`` gives the tokens of ``Engine.generate`` on the
  same image and the chat-encoded prompt (whose own parity with HF is tests/test_vision_generate.py),
  its prompt ids expanded to the image's 20 tokens;
- the refusals, each one line on stderr and exit status 2: a missing or truncated image file
  (before the model loads), a text-only model, ids without a placeholder; and a tokenizer without
  a chat template refuses image parts, naming --prompt-ids.

The tower's patches are 4 pixels, so the published pixel bounds (at least 256 x 256) would give
~1000 image tokens, past the tiny model's context of 256: the model directory gets a
preprocessor_config.json with the small bounds of tests/test_vision_generate.py (a 40 x 28
image is 20 tokens), which ``Engine.load`` reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from dayzero.engine.generate import Engine
from dayzero.engine.image_processing import QwenImageConfig
from dayzero.engine.tokenizer import Tokenizer
from tests.test_cli import _run
from tests.test_vision_dispatch import TOKENS, qwen3vl  # noqa: F401 (the fixture)
from tests.test_vision_generate import SMALL

pytestmark = pytest.mark.usefixtures("quick_compiles")  # tiny programs: XLA's passes off (conftest)

NEW = 4
SPECIAL = {"<|image_pad|>": TOKENS["image_token_id"], "<|video_pad|>": TOKENS["video_token_id"],
           "<|vision_start|>": TOKENS["vision_start_token_id"], "<|vision_end|>": TOKENS["vision_end_token_id"],
           "<|im_start|>": 46, "<|im_end|>": 47}
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,?!:'-\n"  # ids 0-44; 45 is <unk>
# Written for these tests in the manner of the Qwen-VL templates: a part of type image (or one
# holding an image or image_url key) becomes the vision start, one image pad, the vision end.
QWEN_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_vl_tokenizer(directory, template: str | None = QWEN_VL_TEMPLATE) -> None:
    """A byte-level tokenizer over the bytes of ``CHARS`` only (it fits the tiny vocabulary of 64;
    byte-level, so that serve's grammar library reads it), the Qwen special tokens at their ids,
    EOS ``<|im_end|>`` as Qwen's, and (unless None) ``template`` as its chat template."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    # Byte-level BPE spells printable ASCII as itself and bytes 0-32 as chr(256 + byte) (GPT-2's table).
    vocab = {(c if "!" <= c <= "~" else chr(256 + ord(c))): i for i, c in enumerate(CHARS)}
    vocab |= {"<unk>": len(CHARS)} | SPECIAL
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL.items())
    tok.save(str(directory / "tokenizer.json"))
    config = {"unk_token": "<unk>", "eos_token": "<|im_end|>"} | ({"chat_template": template} if template else {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_image(path, seed: int = 0, size=(40, 28)) -> str:
    """A random RGB PNG of ``size`` (width, height); returns its path."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def vl(qwen3vl, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """The converted tiny Qwen3-VL-MoE with the tokenizer (written into its directory), and an
    engine over it with the small pixel bounds."""
    write_vl_tokenizer(qwen3vl.dz_dir)
    (qwen3vl.dz_dir / "preprocessor_config.json").write_text(json.dumps(
        {k: SMALL[k] for k in ("patch_size", "merge_size", "temporal_patch_size", "min_pixels", "max_pixels")}))
    tokenizer = Tokenizer(qwen3vl.dz_dir)
    engine = Engine(qwen3vl.config, qwen3vl.weights, tokenizer, kernels="reference")
    engine.image_config = QwenImageConfig(**SMALL)
    qwen3vl.tokenizer, qwen3vl.engine = tokenizer, engine
    qwen3vl.image = write_image(tmp_path_factory.mktemp("images") / "random.png")
    return qwen3vl


def _one_line_error(rc: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("dayzero: error:"), (rc, err)
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def test_image_parts_render_as_hfs(tmp_path):
    """Two image parts and a text through our sandboxed template = HF's apply_chat_template; the
    ids carry one placeholder per image, each between vision start and end."""
    from transformers import PreTrainedTokenizerFast

    write_vl_tokenizer(tmp_path)
    ours = Tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "why?"}]}]
    text = hf.apply_chat_template(messages, chat_template=QWEN_VL_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == text
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    ids = ours.encode_chat("why?", images=2)
    assert ids == ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    pad = TOKENS["image_token_id"]
    at = [i for i, t in enumerate(ids) if t == pad]
    assert len(at) == 2 and all(ids[i - 1] == TOKENS["vision_start_token_id"] for i in at)
    assert all(ids[i + 1] == TOKENS["vision_end_token_id"] for i in at)
    assert ours.encode_chat("why?") == ours.encode_messages([{"role": "user", "content": "why?"}])


def test_generate_image_equals_engine_generate(vl, capsys):
    """``--image --prompt --json``: Engine.generate's tokens for the chat-encoded prompt and the
    same image; the prompt ids come back with the image's 20 tokens."""
    ids = vl.tokenizer.encode_chat("what is it?", images=1)
    ref = vl.engine.generate(ids, images=[vl.image], max_new_tokens=NEW)
    rc, out, err = _run(["generate", "--model", vl.dz_dir, "--image", vl.image, "--prompt", "what is it?",
                         "--max-new-tokens", NEW, "--json", "--kernels", "reference"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert got["token_ids"] == ref.token_ids and len(ref.token_ids) == NEW
    assert got["prompt_ids"] == ref.prompt_ids and got["prompt_ids"].count(TOKENS["image_token_id"]) == 20
    assert got["text"] == vl.tokenizer.decode(ref.token_ids)


def test_unreadable_image_files_fail_before_loading(tmp_path, capsys):
    """A missing file and a truncated PNG: one line naming the file, before any model loads (the
    model directory does not even exist)."""
    missing = tmp_path / "nope.png"
    rc, _, err = _run(["generate", "--model", tmp_path / "no-model", "--image", missing, "--prompt", "hi"], capsys)
    _one_line_error(rc, err, "--image 1 of 1", str(missing), "does not exist")
    good, cut = write_image(tmp_path / "good.png"), tmp_path / "cut.png"
    cut.write_bytes(open(good, "rb").read()[:200])
    rc, _, err = _run(["generate", "--model", tmp_path / "no-model", "--image", good, "--image", cut,
                       "--prompt", "hi"], capsys)
    _one_line_error(rc, err, "--image 2 of 2", str(cut), "truncated")


def test_refusals_after_loading(vl, tiny_model, tmp_path, capsys):
    """A text-only model, ids without the placeholder: one line each, exit status 2. A tokenizer
    without a chat template cannot place images (TokenizerError, which the CLI reports alike)."""
    rc, _, err = _run(["generate", "--model", tiny_model.dir, "--image", vl.image, "--prompt", "hi"], capsys)
    _one_line_error(rc, err, "no vision tower")
    rc, _, err = _run(["generate", "--model", vl.dz_dir, "--image", vl.image, "--prompt-ids", "1,2,3"], capsys)
    _one_line_error(rc, err, "0 image placeholders", "for 1 images")
    bare = tmp_path / "bare"
    bare.mkdir()
    write_vl_tokenizer(bare, template=None)
    tokenizer = Tokenizer(bare)
    with pytest.raises(ValueError, match="no chat template to place the images in.*--prompt-ids"):
        tokenizer.encode_chat("hi", images=1)
