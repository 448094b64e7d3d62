"""Pallas kernels, each beside its pure-jnp reference (``dayzero.kernels``).

Every op takes ``mode`` (:class:`KernelMode`, or its ``--kernels`` spelling): ``reference``
(pure jnp), ``pallas`` (the Pallas Triton kernel, GPU only), ``pallas_interpret`` (the same
kernel interpreted as XLA ops, any platform; for tests) or ``auto`` (GPU: pallas, else
reference; see :func:`resolve_mode`). Each op's module also exports ``<op>_reference``,
``<op>_pallas(..., interpret=)``, its validator and its block-size table.
"""

from dayzero.kernels.delta_rule import (chunked_delta_rule, chunked_delta_rule_pallas, chunked_delta_rule_reference,
                                       recurrent_delta_step, recurrent_delta_step_pallas, recurrent_delta_step_reference)
from dayzero.kernels.flash_attention import flash_attention, flash_attention_pallas, flash_attention_reference
from dayzero.kernels.mode import KernelError, KernelMode, describe, resolve_mode
from dayzero.kernels.paged_attention import paged_attention, paged_attention_pallas, paged_attention_reference
from dayzero.kernels.paged_latent_attention import (paged_latent_attention, paged_latent_attention_pallas,
                                                    paged_latent_attention_reference)
from dayzero.kernels.sparse_attention import sparse_attention, sparse_attention_pallas, sparse_attention_reference

__all__ = [
    "KernelError", "KernelMode", "describe", "resolve_mode",
    "flash_attention", "flash_attention_pallas", "flash_attention_reference",
    "paged_attention", "paged_attention_pallas", "paged_attention_reference",
    "paged_latent_attention", "paged_latent_attention_pallas", "paged_latent_attention_reference",
    "sparse_attention", "sparse_attention_pallas", "sparse_attention_reference",
    "chunked_delta_rule", "chunked_delta_rule_pallas", "chunked_delta_rule_reference",
    "recurrent_delta_step", "recurrent_delta_step_pallas", "recurrent_delta_step_reference",
]
