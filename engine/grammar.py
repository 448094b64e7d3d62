"""Structured output: ``response_format`` compiled by llguidance into a per-request token constraint.

:class:`Grammars` is built once per server over the model's tokenizer (the HF ``tokenizers``
Tokenizer that ``dayzero.engine.tokenizer`` wraps, handed to ``llguidance.LLTokenizer`` as its
JSON) and turns each request's ``response_format`` into an ``llguidance.LLMatcher`` (building one
takes about a millisecond, so nothing is cached). :class:`GrammarConstraint` wraps that matcher as
the engine's ``TokenConstraint`` protocol: a packed uint32 bitmask of the allowed next tokens (bit
t % 32 of word t // 32 set = token t allowed, llguidance's layout), ``accept`` and ``is_terminated``.

The JSON grammars: ``json_object`` is any JSON object (whitespace between tokens allowed, as
models write it); ``json_schema`` output is laid out like ``json.dumps`` — ``", "`` and ``": "``
separators, no other whitespace — so a small model cannot spend its budget on blanks. Neither
allows whitespace around the top-level value. Once the value is complete only the stop (EOS)
tokens are allowed; the request stops as soon as the grammar cannot go on (after the closing
brace, before any EOS is sampled), or after an EOS where the grammar could have continued.
"""

from __future__ import annotations

import numpy as np

from dayzero.engine.sampling import mask_words
from dayzero.engine.server_protocol import APIError, ResponseFormat
from dayzero.engine.tokenizer import Tokenizer

# json_schema layout (llguidance's JSON compile options; they override any "x-guidance" the schema carries).
_SCHEMA_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _short(message: str) -> str:
    """llguidance's error ``message`` on one line, without its parser-state dump, at most 200 characters."""
    return " ".join(message.split("<state>")[0].split())[:200]


class GrammarConstraint:
    """One request's grammar state (the engine's ``TokenConstraint``)."""

    def __init__(self, matcher, grammar: str, vocab_size: int, matcher_vocab: int | None = None):
        """``matcher``: a fresh ``llguidance.LLMatcher`` of ``grammar`` (its text, kept so that
        other processes can build the same constraint) over a ``matcher_vocab``-token
        ``LLTokenizer`` (default ``vocab_size``); masks cover the model's ``vocab_size`` tokens."""
        self._matcher = matcher
        self.grammar = grammar
        self._words = mask_words(vocab_size)
        # llguidance.numpy's 2-D int32 layout, as wide as the matcher's vocabulary (it may be the larger)
        self._bitmask = np.zeros((1, mask_words(max(vocab_size, matcher_vocab or 0))), np.int32)

    def next_mask(self) -> np.ndarray:
        """The allowed next tokens as a packed uint32 bitmask [ceil(V/32)]."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self._matcher, self._bitmask)
        return self._bitmask[0, : self._words].view(np.uint32).copy()

    def accept(self, token: int) -> None:
        """Advance the grammar over the sampled ``token`` (it was allowed by the last mask)."""
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed "
                               f"({_short(self._matcher.get_error())})")

    def is_terminated(self) -> bool:
        """Whether the grammar is complete (the request then stops): nothing but EOS could follow,
        or an EOS was accepted."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles ``response_format`` values for one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        """``vocab_size``: the model's (its logits' width; tokens past the tokenizer's are never
        allowed); ``stop_token_ids``: the tokens that end a completed grammar (the EOS ids)."""
        import llguidance

        self.vocab_size = vocab_size
        # llguidance needs room for every token the tokenizer knows; the masks are cut to the model's width
        self._matcher_vocab = max(vocab_size, tokenizer.vocab_size)
        self._tokenizer = None
        # Why structured output cannot run (None: it can). A tokenizer llguidance cannot read (no
        # EOS, a decoder it does not know) refuses structured output, not the whole server.
        self.unavailable: str | None = None
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=self._matcher_vocab,
                                                     eos_token=list(stop_token_ids))
        except ValueError as e:
            self.unavailable = f"llguidance cannot read this model's tokenizer: {_short(str(e))}"

    def constraint(self, fmt: ResponseFormat | None) -> GrammarConstraint | None:
        """A fresh constraint for ``fmt`` (None for free text); a schema llguidance cannot compile
        answers 400."""
        if fmt is None or fmt.type == "text":
            return None
        if self.unavailable:
            raise APIError(400, f"structured output is unavailable for this model ({self.unavailable}); "
                                "drop response_format", param="response_format")
        from llguidance import LLMatcher

        if fmt.type == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"})
        elif fmt.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema member with a schema",
                           param="response_format")
        else:
            try:
                grammar = LLMatcher.grammar_from_json_schema(fmt.json_schema.schema_, overrides=_SCHEMA_OPTIONS)
            except ValueError as e:  # llguidance refuses a schema that is not a JSON object
                raise _schema_error(str(e)) from None
        return self.from_grammar(grammar)

    def from_grammar(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for llguidance ``grammar`` text (a constraint's ``grammar``); a
        grammar llguidance cannot compile answers 400."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)  # never raises: a bad schema leaves an error state
        if matcher.is_error():
            raise _schema_error(matcher.get_error())
        return GrammarConstraint(matcher, grammar, self.vocab_size, self._matcher_vocab)


def _schema_error(message: str) -> APIError:
    """The 400 answer to a schema llguidance refused with ``message``."""
    return APIError(400, f"response_format's JSON schema cannot be compiled ({_short(message)}); fix the schema",
                    param="response_format")
