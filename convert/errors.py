"""The one exception the converter raises for a user's mistake or a bad input file."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint that cannot be converted or loaded; the message says what and what to do.

    Subclassing ``ValueError`` lets the CLI catch config errors (``ConfigError``, also a
    ``ValueError``) and conversion errors the same way.
    """
