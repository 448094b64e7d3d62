"""A tokenizer llguidance cannot read (no EOS id, a decoder it does not know) turns structured
output off with a 400 that says why, instead of stopping ``dayzero serve`` at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models

from dayzero.engine.grammar import Grammars
from dayzero.engine.server_protocol import APIError, ResponseFormat


def _tokenizer(decoder=None) -> SimpleNamespace:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    if decoder is not None:
        tok.decoder = decoder
    return SimpleNamespace(_tok=tok, vocab_size=2)


@pytest.mark.parametrize("decoder, stop, reason", [(None, (), "eos_token list must not be empty"),
                                                   (decoders.Fuse(), (1,), "decoder type")])
def test_unreadable_tokenizer_refuses_structured_output_only(decoder, stop, reason):
    grammars = Grammars(_tokenizer(decoder), 2, stop)
    assert reason in grammars.unavailable
    assert grammars.constraint(None) is None  # free text is unaffected
    with pytest.raises(APIError, match=f"structured output is unavailable.*{reason}.*drop response_format"):
        grammars.constraint(ResponseFormat(type="json_object"))
