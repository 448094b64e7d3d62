"""Checkpoint conversion: HF / PyTorch / GGUF checkpoints -> dayzero Orbax checkpoints.

Public API: :func:`convert_checkpoint` (SRC -> DST directory), :func:`load_checkpoint`
(DST -> ``(ModelConfig, Weights)``), :func:`verify_checkpoint` (recheck stored bytes against the
manifest) and :class:`ConvertError` (every user-facing failure).
"""

from dayzero.convert.checkpoint import load_checkpoint, verify_checkpoint
from dayzero.convert.convert import convert_checkpoint
from dayzero.convert.errors import ConvertError

__all__ = ["convert_checkpoint", "load_checkpoint", "verify_checkpoint", "ConvertError"]
