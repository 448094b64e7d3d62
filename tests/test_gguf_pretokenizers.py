"""GGUF pre-tokenizers ``deepseek-v3`` (DeepSeek-V3 / R1) and ``kimi-k2`` (Kimi-K2) against
oracles taken from the models' own published files, not from dayzero's regexes:

- DeepSeek-V3: the ``pre_tokenizer`` section of its published ``tokenizer.json`` (below, as JSON
  text), loaded by HF ``tokenizers`` (``Tokenizer.from_str``);
- Kimi-K2: the ``pat_str`` of its ``tokenization_kimi.py`` (a tiktoken pattern), applied as tiktoken
  does (every match a piece, byte-level BPE inside each) with the Python ``regex`` module (tiktoken
  itself is not installed here).

Both on multilingual text (CJK, kana, Hangul, digit runs, punctuation, newlines, runs of spaces,
emoji, contractions), then end to end: a tiny GGUF whose ``tokenizer.ggml.pre`` names the family,
converted, must encode as the oracle does. The texts tell each family from its nearest
neighbour (Llama-3's split, GPT-4o's), so a wrong mapping fails.
"""

from __future__ import annotations

import json

import gguf
import pytest
import regex
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from dayzero.convert.tokenizer_export import PRE_TOKENIZERS
from tests.convert_helpers import assert_fails, convert, small_hf_model
from tests.test_convert_gguf import add_gguf_hparams, byte_level_vocab, gguf_tensors, write_gguf_tensors

# deepseek-ai/DeepSeek-V3 (Hugging Face Hub), tokenizer.json, "pre_tokenizer" (DeepSeek-R1 has the
# same); llama.cpp's src/llama-vocab.cpp maps tokenizer.ggml.pre "deepseek-v3" to these regexes.
DEEPSEEK_V3_PRE_TOKENIZER = r"""{
  "type": "Sequence",
  "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[一-龥぀-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]
}"""

# moonshotai/Kimi-K2-Instruct (Hugging Face Hub), tokenization_kimi.py, TikTokenTokenizer.pat_str;
# llama.cpp's "kimi-k2" pre-tokenizer implements the same split.
KIMI_K2_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Python regex knows the ``&&`` class intersection only in its VERSION1 mode.
KIMI_K2_REGEX = regex.compile(KIMI_K2_PAT_STR, flags=regex.V1)

TEXTS = [
    "Hello world! I'm here, you're there; they'll see. DON'T SHOUT, she's OK",
    "数字 1234567 和 12,345.67 以及 ١٢٣٤٥ 1212",
    "中文English混合 日本語のテキスト、ひらがな カタカナ 한국어 텍스트 𠀀鿿",
    "emoji 🎉🚀👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷!",
    "tabs\tand  spaces   \n\n\r\n  trailing   ",
    "punctuation...!!! (a+b)*c=d; x->y /path/to/file.txt \"quoted\" 'single'\n",
    "café naïve e\u0301t\u00e9 ÉTÉ Straße ΑΒΓ αβγ Кириллица CamelCaseWORDS",
    ".NET .the ,and #hashtag @user $var a.b.c",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "中文，标点。“引号”！\n\u3000全角\u00a0nbsp",
    "", " ", "\n", "x", "  \t\n",
]


def _published_deepseek_v3(vocab: dict[str, int] | None = None, merges: list | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer (the tiny vocabulary, or none) with DeepSeek-V3's published pre-tokenizer."""
    tok = Tokenizer(models.BPE(vocab=vocab or {}, merges=merges or []))
    spec = json.loads(tok.to_str())
    spec["pre_tokenizer"] = json.loads(DEEPSEEK_V3_PRE_TOKENIZER)
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    return Tokenizer.from_str(json.dumps(spec))


_BYTES = bytes_to_unicode()


def _kimi_pieces(text: str) -> list[str]:
    """tiktoken's split of ``text`` with Kimi-K2's pattern, in GPT-2's byte-to-character alphabet."""
    pieces = KIMI_K2_REGEX.findall(text)
    assert "".join(pieces) == text  # the pattern covers every character: nothing dropped
    return ["".join(_BYTES[b] for b in p.encode()) for p in pieces]


def _ours(pre: str, text: str) -> list[tuple[str, tuple[int, int]]]:
    return PRE_TOKENIZERS[pre]().pre_tokenize_str(text)


@pytest.mark.parametrize("text", TEXTS)
def test_deepseek_v3_splits_as_published(text):
    oracle = _published_deepseek_v3().pre_tokenizer.pre_tokenize_str(text)
    assert _ours("deepseek-v3", text) == oracle  # pieces and their offsets


@pytest.mark.parametrize("text", TEXTS)
def test_kimi_k2_splits_as_its_tiktoken_pattern(text):
    assert [p for p, _ in _ours("kimi-k2", text)] == _kimi_pieces(text)


def test_the_texts_tell_the_families_apart():
    """Each family splits some text unlike its nearest neighbour (so a wrong mapping fails above)."""
    for pre, neighbour in (("deepseek-v3", "llama-bpe"), ("deepseek-v3", "qwen2"), ("kimi-k2", "minimax-m2"),
                           ("kimi-k2", "llama-bpe")):
        differ = [t for t in TEXTS if _ours(pre, t) != _ours(neighbour, t)]
        assert len(differ) >= 3, (pre, neighbour, differ)


def _oracle_ids(pre: str, vocab: dict[str, int], merges: list[tuple[str, str]], text: str) -> list[int]:
    if pre == "deepseek-v3":
        return _published_deepseek_v3(vocab, merges).encode(text).ids
    # tiktoken: BPE inside each piece of the pattern's split.
    plain = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [i for piece in KIMI_K2_REGEX.findall(text) for i in plain.encode(piece).ids]


def _write_gguf(path, pre: str, with_merges: bool = True):
    """A tiny llama GGUF whose byte-level vocabulary is ``byte_level_vocab`` plus the merge "Ġ ä"
    (a space and the first byte of 中, U+4E2D): both families split a space from a following Han
    character, which Llama-3's and GPT-4o's splits keep together, so only a wrong split merges it."""
    tokens, merges, types = byte_level_vocab()
    tokens, merges, types = tokens + ["Ġä"], merges + ["Ġ ä"], types + [1]
    model = small_hf_model("llama", vocab_size=len(tokens))
    w = gguf.GGUFWriter(path, "llama")
    add_gguf_hparams(w, model.config)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if with_merges:
        w.add_token_merges(merges)
    write_gguf_tensors(w, gguf_tensors(model))
    return path, {t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]


@pytest.mark.parametrize("pre", ["deepseek-v3", "kimi-k2"])
def test_gguf_tokenizer_encodes_as_the_oracle(tmp_path, pre):
    src, vocab, merges = _write_gguf(tmp_path / "tiny.gguf", pre)
    ours = Tokenizer.from_file(str(convert(src, tmp_path / "dz") / "tokenizer.json"))
    for text in TEXTS + ["the 1212 in there", "there12the 中文 在 中国"]:
        ids = ours.encode(text).ids
        assert ids == _oracle_ids(pre, vocab, merges, text), text
        assert ours.decode(ids) == text
    # The space before 中 is a piece of its own; "1212" is cut after three digits (the merge "1 2").
    assert vocab["Ġä"] not in ours.encode("x 中文").ids and vocab["Ġ"] in ours.encode("x 中文").ids
    assert ours.encode("1212").ids == [vocab["12"], vocab["1"], vocab["2"]]


def test_gguf_without_merges_is_refused(tmp_path):
    """llama.cpp reads a "kimi-k2" vocabulary without merges; byte-level BPE without merges would
    make every byte a token, so conversion refuses it and says what to do."""
    src, _, _ = _write_gguf(tmp_path / "nomerges.gguf", "kimi-k2", with_merges=False)
    assert_fails(src, tmp_path / "dz", "tokenizer.ggml.merges is missing")
