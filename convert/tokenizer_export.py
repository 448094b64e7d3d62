"""Carry the tokenizer over into a converted checkpoint.

From an HF directory the tokenizer files are copied as they are. A GGUF file has no
``tokenizer.json``: llama.cpp stores the vocabulary, merges, token types and special ids as
metadata, and names the pre-tokenizer (``tokenizer.ggml.pre``) after the model family. We rebuild
a ``tokenizers.Tokenizer`` from that, splitting text the way llama.cpp does for that family.

A multimodal model's image preprocessing (``preprocessor_config.json``: Qwen's HF keys or Kimi-K2.5's
``media_proc_cfg``; or transformers 5's ``processor_config.json``) travels with the tokenizer files:
checked against the vision tower before conversion starts (:func:`image_config_in`), copied as
published, read back by ``Engine.load``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from dayzero.convert.errors import ConvertError
from dayzero.model.config import ModelConfig
from dayzero.model.hf_config_vision_kimi import KimiVisionConfig

HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "chat_template.jinja",
)
# A multimodal model's image preprocessing, copied only when the model has a vision tower: the
# file an image processor is saved in, or since transformers 5 the processor's own file, with the
# image processor's keys under "image_processor" (which HF's loader reads first).
PREPROCESSOR_CONFIG, PROCESSOR_CONFIG = "preprocessor_config.json", "processor_config.json"
IMAGE_PROCESSOR_FILES = ((PROCESSOR_CONFIG, "image_processor"), (PREPROCESSOR_CONFIG, None))

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are
# matched whole in the text but are ordinary text when decoded (e.g. ``<think>``).
_CONTROL, _USER_DEFINED = 3, 4

# The Llama-3 / cl100k split: contractions, letters with one leading non-letter, numbers in runs
# of at most three digits, punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # Byte-level with GPT-2's own split regex; no space is prepended to the text.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's regex list for these families is ["\p{N}", <gpt-2 regex>]: every digit is its own
    # piece, then GPT-2's split. SmolLM2's own tokenizer.json says the same with Digits + ByteLevel.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2()]
    )


# Qwen2's split (also Qwen2.5, Qwen3 and the DeepSeek-R1 distills of Qwen): Llama-3's, except
# that every digit is a piece of its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


# The GPT-4o (o200k) split that llama.cpp names "minimax-m2" for MiniMax-M2: a word is an optional
# non-letter, then upper-case-ish letters and lower-case-ish letters in either order, then an
# optional English contraction; numbers in runs of at most three digits; punctuation runs may
# swallow trailing newlines and slashes.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral-Nemo and later): the same words without contractions, single digits.
_TEKKEN_SPLIT = _GPT4O_SPLIT.replace(_CONTRACTION, "").replace(r"\p{N}{1,3}", r"\p{N}")


# Kimi-K2's tiktoken split (llama.cpp's "kimi-k2"): runs of Han characters first, then GPT-4o's
# words with Han taken out of their letter classes (Oniguruma's ``&&`` class intersection, as in
# Moonshot's pattern), numbers in runs of at most three digits; punctuation runs swallow trailing
# newlines only.
_HAN_FREE = r"&&[^\p{Han}]]"
_KIMI_SPLIT = r"[\p{Han}]+|" + (
    _GPT4O_SPLIT.replace(_UPPER, _UPPER[:-1] + _HAN_FREE).replace(_LOWER, _LOWER[:-1] + _HAN_FREE)
    .replace(r"[\r\n/]*", r"[\r\n]*")
)

# DeepSeek-V3 / R1's three splits (llama.cpp's "deepseek-v3"), applied one after the other as its
# tokenizer.json chains them: runs of at most three digits; runs of CJK ideographs U+4E00-U+9FA5
# and kana U+3040-U+30FF; then words (an ASCII punctuation mark may lead a run of ASCII letters,
# a non-letter that is not punctuation or a symbol may lead letters and marks), punctuation and
# symbol runs that swallow trailing newlines, newlines, other whitespace.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


def _regex_then_bytes(*splits: str) -> pre_tokenizers.PreTokenizer:
    # Each split cuts the pieces the previous one left, keeping matches and gaps alike as pieces.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _llama3() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(_LLAMA3_SPLIT)


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(_QWEN2_SPLIT)


def _gpt4o() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(_GPT4O_SPLIT)


def _tekken() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(_TEKKEN_SPLIT)


def _kimi_k2() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(_KIMI_SPLIT)


def _deepseek3() -> pre_tokenizers.PreTokenizer:
    return _regex_then_bytes(*_DEEPSEEK3_SPLITS)


# tokenizer.ggml.pre -> pre-tokenizer (byte-level BPE vocabularies only).
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "llama-bpe": _llama3,
    "qwen2": _qwen2,
    "deepseek-r1-qwen": _qwen2,
    "minimax-m2": _gpt4o,
    "tekken": _tekken,
    "kimi-k2": _kimi_k2,
    "deepseek-v3": _deepseek3,
}


def copy_hf_tokenizer(src_dir: Path, dst: Path) -> list[str]:
    """Copy the tokenizer and generation files an HF directory has; return their names."""
    copied = []
    for name in HF_TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dst / name)
            copied.append(name)
    return copied


def _tower_sizes(image: Any, vision: Any) -> dict[str, tuple[Any, Any]]:
    """``{key: (preprocessor's value, tower's value)}`` of the sizes both must agree on."""
    if isinstance(vision, KimiVisionConfig):
        return {"patch_size": (image.patch_size, vision.patch_size),
                "merge_size": ((image.merge_size,) * 2, tuple(vision.merge_kernel))}
    return {"patch_size": (image.patch_size, vision.patch_size),
            "merge_size": (image.merge_size, vision.spatial_merge_size),
            "temporal_patch_size": (image.temporal_patch_size, vision.temporal_patch_size)}


def _image_processor_dict(path: Path, nested: str | None) -> dict[str, Any] | None:
    """The image processor keys ``path`` holds (under ``nested`` if given; None if it nests none).
    Raises ValueError (json's included) for a file that is not JSON or holds no object there."""
    raw = json.loads(path.read_text())
    if nested is not None and isinstance(raw, dict):
        if nested not in raw:
            return None
        raw = raw[nested]
    if not isinstance(raw, dict):
        raise ValueError(f"it holds a JSON {type(raw).__name__} where an object of image processor keys belongs")
    return raw


def _checked_image_config(directory: Path | None, config: ModelConfig) -> tuple[str, Any] | None:
    """``(file name, image config)`` of :func:`image_config_in`, or None."""
    if directory is None or config.vision is None:
        return None
    # Imported here: the image code is the engine's, and a text-only conversion never needs it.
    from dayzero.engine.image_processing import KimiImageConfig, QwenImageConfig

    kind = KimiImageConfig if isinstance(config.vision, KimiVisionConfig) else QwenImageConfig
    for name, nested in IMAGE_PROCESSOR_FILES:
        path = directory / name
        if not path.is_file():
            continue
        fix = (f"fix the file, or remove it (with no image preprocessor config the tower's sizes and the "
               f"published {kind.__name__} defaults apply)")
        try:  # ImageConfigError is a ValueError, as are json's and UnicodeDecodeError
            raw = _image_processor_dict(path, nested)
            if raw is None:
                continue
            image = kind.from_preprocessor_config(raw)
        except (TypeError, ValueError) as e:
            raise ConvertError(f"{path} is not a usable image preprocessor config ({e}); {fix}") from None
        wrong = [f"{k}={ours!r} where the vision tower has {tower!r}"
                 for k, (ours, tower) in _tower_sizes(image, config.vision).items() if ours != tower]
        if wrong:
            raise ConvertError(f"{path} does not fit the model's vision tower ({'; '.join(wrong)}); {fix}")
        return name, image
    return None


def image_config_in(directory: Path | None, config: ModelConfig) -> Any:
    """The image preprocessing ``directory`` gives ``config``'s vision tower (a
    ``dayzero.engine.image_processing`` ``KimiImageConfig`` for Kimi-K2.5's tower, else a
    ``QwenImageConfig``), found as HF's image processor loader finds it: the ``image_processor``
    object of ``processor_config.json``, else ``preprocessor_config.json``. None when the model has
    no tower or the directory neither file.

    Raises :class:`ConvertError` naming the file for one that is not a JSON object, that the
    parser refuses (an unknown key, an unsupported switch), or whose patch sizes are not the tower's.
    """
    found = _checked_image_config(directory, config)
    return None if found is None else found[1]


def copy_preprocessor_config(src_dir: Path | None, dst: Path, config: ModelConfig) -> list[str]:
    """Copy, as published, the file :func:`image_config_in` takes the image preprocessing from
    (when ``config`` has a vision tower and the file checks out); return the names copied."""
    found = _checked_image_config(src_dir, config)
    if found is None:
        return []
    shutil.copyfile(src_dir / found[0], dst / found[0])
    return [found[0]]


def _byte_level_bpe(meta: Callable[[str], Any]) -> Tokenizer:
    """The BPE model, pre-tokenizer and decoder of a ``gpt2`` (byte-level BPE) vocabulary."""
    pre = meta("tokenizer.ggml.pre") or "gpt-2"
    if pre not in PRE_TOKENIZERS:
        raise ConvertError(
            f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = meta("tokenizer.ggml.tokens")
    if meta("tokenizer.ggml.merges") is None:
        # Without merges every byte would be a token of its own: wrong ids, silently.
        raise ConvertError("GGUF tokenizer.ggml.merges is missing from a byte-level BPE vocabulary; "
                           "convert the model's HF directory, or a GGUF written with its merges")
    merges = [tuple(m.split(" ")) for m in meta("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ConvertError("GGUF tokenizer.ggml.merges has an entry that is not two tokens; the file is corrupt")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, which a GGUF stores only as token scores: every split of a
    token into two tokens is a merge, ranked by the merged token's score (best first; among
    equal scores, longer left pieces first, then by token ids, for a deterministic order)."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), ids[token], ids[left], ids[right], left, right))
    return [(r[-2], r[-1]) for r in sorted(ranked)]


def _sentencepiece_bpe(meta: Callable[[str], Any]) -> Tokenizer:
    """The BPE model, pre-tokenizer and decoder of a ``llama`` (SentencePiece BPE) vocabulary:
    spaces become ``▁`` (one prepended to the text unless ``tokenizer.ggml.add_space_prefix`` is
    false), characters outside the vocabulary fall back to ``<0xNN>`` byte tokens."""
    tokens, scores = list(meta("tokenizer.ggml.tokens")), meta("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConvertError("GGUF tokenizer.ggml.scores is missing or not one per token; the file is corrupt")
    unk = meta("tokenizer.ggml.unknown_token_id")
    prefix = meta("tokenizer.ggml.add_space_prefix")
    prefix = True if prefix is None else bool(prefix)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_merges_from_scores(tokens, scores),
                               unk_token=None if unk is None else tokens[unk], fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


# tokenizer.ggml.model -> (builder, whether BOS is added when the file does not say).
_TOKENIZER_MODELS = {"gpt2": (_byte_level_bpe, False), "llama": (_sentencepiece_bpe, True)}


def _adds_bos(meta: Callable[[str], Any]) -> bool:
    """``tokenizer.ggml.add_bos_token``, or llama.cpp's default for the vocabulary type."""
    flag = meta("tokenizer.ggml.add_bos_token")
    return _TOKENIZER_MODELS[meta("tokenizer.ggml.model")][1] if flag is None else bool(flag)


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Register CONTROL tokens as special and USER_DEFINED ones as whole-matched added tokens."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool,
                    byte_level: bool):
    """BOS/EOS insertion as the file asks (``tokenizer.ggml.add_bos_token`` / ``add_eos_token``)."""
    single, pair, specials = "$A", "$A $B", []
    for flag, idx, before in ((add_bos, bos, True), (add_eos, eos, False)):
        if not flag:
            continue
        if idx is None:
            raise ConvertError("GGUF asks to add a BOS/EOS token but gives no token id for it")
        name = tokens[idx]
        single = f"{name} {single}" if before else f"{single} {name}"
        pair = f"{name} $A {name} $B" if before else f"{pair} {name}"
        specials.append((name, idx))
    if not specials:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def gguf_tokenizer(meta: Callable[[str], Any]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to the one a GGUF file describes.

    ``meta(key)`` returns a metadata value or None. Byte-level BPE (``tokenizer.ggml.model`` =
    ``gpt2``) and SentencePiece BPE (``llama``: Llama-2, Mistral-7B) are supported; anything else
    raises :class:`ConvertError`.
    """
    model = meta("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise ConvertError(
            f"GGUF tokenizer.ggml.model={model!r} is not supported (supported: 'gpt2', byte-level BPE, and "
            "'llama', SentencePiece BPE); convert the model's HF directory instead"
        )
    tokens = list(meta("tokenizer.ggml.tokens"))
    tok = _TOKENIZER_MODELS[model][0](meta)
    _add_special_tokens(tok, tokens, list(meta("tokenizer.ggml.token_type") or []))
    processor = _post_processor(
        tokens, meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id"),
        _adds_bos(meta), bool(meta("tokenizer.ggml.add_eos_token")), model == "gpt2",
    )
    if processor is not None:
        tok.post_processor = processor
    return tok


def write_gguf_tokenizer(meta: Callable[[str], Any], dst: Path) -> list[str]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``."""
    tok = gguf_tokenizer(meta)
    tok.save(str(dst / "tokenizer.json"))
    tokens = meta("tokenizer.ggml.tokens")
    ids = {name: meta(f"tokenizer.ggml.{key}") for name, key in
           (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, idx in ids.items():
        if idx is not None:
            tok_config[f"{name}_token"] = tokens[idx]
    tok_config["add_bos_token"] = _adds_bos(meta)
    tok_config["add_eos_token"] = bool(meta("tokenizer.ggml.add_eos_token"))
    if meta("tokenizer.chat_template"):
        tok_config["chat_template"] = meta("tokenizer.chat_template")
    gen_config = {f"{name}_token_id": int(idx) for name, idx in ids.items() if idx is not None and name != "unk"}
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (dst / "generation_config.json").write_text(json.dumps(gen_config, indent=2))
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
