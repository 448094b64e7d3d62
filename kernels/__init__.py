"""Pallas kernels, each beside its pure-jnp reference (``dayzero.kernels``).

Every op takes ``mode`` (:class:`KernelMode`, or its ``--kernels`` spelling): ``reference``
(pure jnp), ``pallas`` (the Pallas Triton kernel, GPU only), ``pallas_interpret`` (the same
kernel interpreted as XLA ops, any platform; for tests) or ``auto`` (GPU: pallas, else
reference; see :func:`resolve_mode`). Each op's module also exports ``<op>_reference``,
``<op>_pallas(..., interpret=)``, its validator and its block-size table.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _load_hub_kernels():
    """Load Hugging Face's ``kernels`` distribution under the top-level name ``kernels``.

    This folder is imported as the top-level ``kernels`` only when the repository root is on sys.path
    ahead of site-packages (pytest's ``pythonpath``, or a script or ``python -m`` run from the
    checkout). That name belongs to Hugging Face's package, which transformers >= 5.25 requires and
    imports; without this, every HF model in the tests failed to import. dayzero's own kernels are
    only ever ``dayzero.kernels``.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.realpath(os.path.dirname(here))
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        raise ImportError(f"the top-level module 'kernels' is Hugging Face's package, which is not installed; "
                          f"{here} is dayzero's, imported as 'dayzero.kernels'")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # before running it: its own submodule imports look it up here
    spec.loader.exec_module(module)
    return module


if __name__ != "dayzero.kernels":
    sys.modules[__name__] = _load_hub_kernels()  # what ``import kernels`` then returns
else:
    from dayzero.kernels.delta_rule import (chunked_delta_rule, chunked_delta_rule_pallas,
                                           chunked_delta_rule_reference, recurrent_delta_step,
                                           recurrent_delta_step_pallas, recurrent_delta_step_reference)
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
