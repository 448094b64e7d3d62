"""OpenAI response bodies of ``dayzero serve``: completions, chat completions, their stream chunks,
log-probabilities and usage, built from the step loop's :class:`~dayzero.engine.server_loop.Update`s."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from dayzero.engine.server_loop import Update
from dayzero.engine.tokenizer import Tokenizer


class Shaper:
    """Builds one HTTP request's response objects (``chat`` or legacy completions)."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer | None, logprobs: bool, token_ids: bool = False):
        self.chat, self.model, self._tokenizer, self.logprobs = chat, model, tokenizer, logprobs
        self.token_ids = token_ids  # vLLM's ``return_token_ids``
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def token_text(self, token: int) -> str:
        """One token's text (special tokens spelled out), as logprobs name tokens."""
        return self._tokenizer.decode([token], skip_special_tokens=False) if self._tokenizer else str(token)

    def _logprobs(self, tokens: list[tuple[int, float, tuple]], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, lp, top in tokens], "refusal": None}
        texts = [self.token_text(t) for t, _, _ in tokens]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in tokens],
                "top_logprobs": [self._top_dict(top) for _, _, top in tokens],
                "text_offset": offsets}

    def _top_dict(self, top: tuple) -> dict[str, float]:
        """Legacy completions' ``{token text: logprob}``; tokens that decode alike (parts of one
        UTF-8 character) share a key, which keeps the most likely one's value."""
        out: dict[str, float] = {}
        for t, lp in top:
            out.setdefault(self.token_text(t), lp)
        return out

    def _chat_entry(self, token: int, logprob: float, top: tuple) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (s := self.token_text(t)), "logprob": lp, "bytes": list(s.encode())}
                                 for t, lp in top]}

    def chunk(self, update: Update, first: bool, offset: int) -> dict[str, Any]:
        """The stream chunk of ``update`` (``first``: the choice's first chunk, which names the
        role in chat; ``offset``: characters of the choice's text sent before)."""
        choice: dict[str, Any] = {"index": update.index, "logprobs": self._logprobs(update.tokens, offset),
                                  "finish_reason": update.finish_reason}
        if self.token_ids:
            choice["token_ids"] = [t for t, _, _ in update.tokens]
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if update.text or first:
                delta["content"] = update.text
            choice["delta"] = delta
        else:
            choice["text"] = update.text
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``."""
        return {**self._head(True), "choices": [], "usage": usage}

    def full(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        """The non-streamed response over collected ``choices`` (see :class:`Collected`)."""
        out = []
        for c in choices:
            entry: dict[str, Any] = {"index": c["index"], "finish_reason": c["finish_reason"],
                                     "logprobs": self._logprobs(c["tokens"], 0)}
            if self.token_ids:
                entry["token_ids"] = [t for t, _, _ in c["tokens"]]
            if self.chat:
                entry["message"] = {"role": "assistant", "content": c["text"]}
            else:
                entry["text"] = c["text"]
            out.append(entry)
        return {**self._head(False), "choices": out, "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """An OpenAI ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
