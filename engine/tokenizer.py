"""Tokenizer and chat template of a converted model (HF ``tokenizers`` + a sandboxed Jinja)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be used."""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are either strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise TokenizerError(f"the chat template refused the conversation: {message}")


class Tokenizer:
    """Encodes, decodes and applies the chat template of one model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{model_dir} has no tokenizer.json; convert the model with its tokenizer files")
        self._tok = HFTokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.exists() else config.get("chat_template")
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids = self._eos_ids(generation)

    def _eos_ids(self, generation: dict[str, Any]) -> tuple[int, ...]:
        ids = generation.get("eos_token_id")
        if ids is None and self.eos_token is not None:
            ids = self._tok.token_to_id(self.eos_token)
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, list) else (int(ids),)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS/EOS post-processing if asked)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Apply the model's chat template (Jinja, sandboxed) to ``messages``. A message's
        ``content`` is text, or a list of parts as HF's multimodal templates take them:
        ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` (where the template writes the
        image's placeholder, e.g. Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; drop --chat and pass the raw prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        try:
            template = env.from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the model's chat template does not parse: {e}") from None
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError) as e:  # e.g. a text-only template given content parts
            raise TokenizerError(f"the model's chat template cannot render this conversation: {e}") from None

    def encode_messages(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the chat template (see :meth:`render_chat`)."""
        text = self.render_chat(messages, add_generation_prompt)
        # The template already placed any BOS it wants; adding special tokens would double it.
        return self.encode(text, add_special_tokens=False)

    def encode_chat(self, user_message: str, images: int = 0) -> list[int]:
        """Token ids of a one-turn conversation, ready for the assistant's answer; with
        ``images``, that many image parts come before the text (the order of HF's and Qwen's
        examples), so the template writes one image placeholder each."""
        if not images:
            return self.encode_messages([{"role": "user", "content": user_message}])
        if not self.chat_template:
            raise TokenizerError("this model has no chat template to place the images in; pass --prompt-ids "
                                 "with one image placeholder token per image")
        parts: list[dict[str, str]] = [{"type": "image"} for _ in range(images)]
        parts += [{"type": "text", "text": user_message}] if user_message else []
        return self.encode_messages([{"role": "user", "content": parts}])


class StreamDecoder:
    """Turns a growing list of token ids into text increments, never splitting a character."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final with it (maybe empty)."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text still held back (an incomplete UTF-8 tail) once no more tokens will come."""
        return self._advance(self._tokenizer.decode(self._ids))

    def _advance(self, text: str) -> str:
        delta = text[len(self._emitted):] if text.startswith(self._emitted) else text
        self._emitted = text
        return delta
