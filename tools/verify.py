"""``dayzero verify``: a converted checkpoint against the HF transformers original, layer by layer.

Both sides run the same prompt ids in fp32 on CPU: HF transformers on the original checkpoint
(an HF directory, a PyTorch state dict beside its config.json, or a .gguf file) and dayzero's
``forward`` on the conversion. Each decoder layer's output is compared, then the logits.

Where HF's layer outputs come from: forward hooks on the decoder layers, not
``output_hidden_states``. In transformers 5 the last entry of ``hidden_states`` is overwritten by
the final-norm output (``capture_outputs(tie_last_hidden_states=True)``), so it is not the last
layer's raw output; a hook sees every layer's output as that layer returns it. A layer that
returns a tuple (MoE layers may add router logits) contributes its first element, so MoE families
slot in without changes here.

Definitions (all per layer, over every token and channel of the prompt):

- ``max_abs_err``: max |ours - reference|; ``ref_max_abs``: max |reference|;
  ``rel_err = max_abs_err / ref_max_abs``.
- A layer is within tolerance when ``max_abs_err <= atol + rtol * ref_max_abs``.
- ``first_bad_layer``: the first layer (0-based, as in ``model.layers.<i>``) not within tolerance;
  ``None`` when all are. This is the verdict's pointer to the fault.
- ``first_jump_layer``: the first layer whose ``rel_err`` is more than ``JUMP_FACTOR`` (10) times
  the previous layer's and above a noise floor of ``rtol / 100``. The input of layer 0 is an
  exact embedding lookup on both sides, so layer 0 jumps when it is above the floor. A fault too
  small to break tolerance where it sits, but amplified by later layers, shows here before
  ``first_bad_layer``; the floor keeps fp32 rounding noise (growing from 1e-8 to 1e-7, say) from
  being called a jump.
- At the logits: max abs error, per-token KL(reference || ours) (mean and max, in nats, computed
  in float64) and top-1 agreement (fraction of positions whose argmax is the same).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dayzero.convert.sources import TORCH_SUFFIXES

# Defaults. fp32 on both sides agrees to ~1e-6 relative per layer in our tests (the only
# difference is summation order), and a real bug (wrong RoPE, norm, bias, transposed or
# perturbed weight) moves a layer's output by 1e-2 relative or more; 1e-3 sits between the two
# with room for models deeper than our tests. Greedy decoding must not change, so every
# position's argmax must agree. A KL of 1e-4 nats per token is far above fp32 noise (~1e-10) and
# far below what a wrong layer gives (1e-2 and up).
DEFAULT_RTOL = 1e-3
DEFAULT_ATOL = 0.0
DEFAULT_MAX_KL = 1e-4
DEFAULT_MIN_TOP1 = 1.0
JUMP_FACTOR = 10.0

# The default prompt: ordinary English of about 200 tokens, long enough that RoPE and masking
# mistakes show, short enough to run both models quickly on a CPU.
DEFAULT_PROMPT = (
    "The old lighthouse stood at the edge of the harbor for more than a century, and every night "
    "its keeper climbed the narrow spiral stairs to light the lamp. Sailors who had never met him "
    "knew the rhythm of his beam: two long sweeps, a pause, and one short flash that meant the "
    "rocks to the north were close. In the winter the wind came off the sea so hard that the "
    "windows rattled in their frames, and the keeper wrote in his logbook by the light of a small "
    "oil lamp, noting the weather, the ships that passed, and the birds that sheltered on the "
    "gallery rail. When the town council decided to replace the lamp with an automatic one, many "
    "people came to the meeting to object. They said that a machine could turn a light on and "
    "off, but it could not notice a fishing boat in trouble, or row out in a storm, or remember "
    "the names of the families who waited on the pier. The council listened politely, voted, and "
    "installed the new lamp the following spring. The keeper stayed on anyway, without pay, "
    "because, as he told a reporter, somebody still had to watch the water."
)


class VerifyError(ValueError):
    """Bad input to ``dayzero verify`` (missing reference, unusable prompt, mismatched models)."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Pass criteria; see the module docstring for what each number bounds."""

    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    max_kl: float = DEFAULT_MAX_KL
    min_top1: float = DEFAULT_MIN_TOP1


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """Error of one decoder layer's output."""

    layer: int
    max_abs_err: float
    ref_max_abs: float
    rel_err: float
    within_tolerance: bool
    growth: float | None  # rel_err / previous layer's rel_err (None for layer 0 or a zero previous)
    jump: bool


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything ``dayzero verify`` found; ``to_json()`` is what ``--json`` prints."""

    num_tokens: int
    layers: list[LayerRow]
    logits: dict[str, float]
    first_bad_layer: int | None
    first_jump_layer: int | None
    failures: list[str]
    tolerance: Tolerance

    @property
    def passed(self) -> bool:
        """True when every criterion holds."""
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        """One JSON-serialisable object: layer rows, logits stats, first bad layer, verdict."""
        return {
            "num_tokens": self.num_tokens,
            "layers": [dataclasses.asdict(row) for row in self.layers],
            "logits": self.logits,
            "first_bad_layer": self.first_bad_layer,
            "first_jump_layer": self.first_jump_layer,
            "tolerance": dataclasses.asdict(self.tolerance),
            "failures": self.failures,
            "passed": self.passed,
        }

    def verdict(self) -> str:
        """One line: PASS, or FAIL with every broken criterion."""
        if self.passed:
            return f"PASS: {len(self.layers)} layers and the logits within tolerance on {self.num_tokens} tokens"
        return "FAIL: " + "; ".join(self.failures)


# --- comparing -------------------------------------------------------------------------------------


def _layer_rows(ref: Sequence[np.ndarray], ours: Sequence[np.ndarray], tol: Tolerance) -> list[LayerRow]:
    floor = tol.rtol / 100
    rows, previous = [], 0.0  # layer 0's input is an exact embedding lookup on both sides
    for i, (r, o) in enumerate(zip(ref, ours)):
        err = float(np.max(np.abs(o.astype(np.float64) - r)))
        scale = float(np.max(np.abs(r)))
        rel = err / scale if scale > 0 else err
        growth = rel / previous if previous > 0 else None
        jump = rel > floor and rel > JUMP_FACTOR * previous
        ok = err <= tol.atol + tol.rtol * scale
        rows.append(LayerRow(i, err, scale, rel, ok, growth, jump))
        previous = rel
    return rows


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def logits_stats(ref: np.ndarray, ours: np.ndarray, chunk: int = 64) -> dict[str, float]:
    """Max abs error, mean/max per-token KL(ref || ours) and top-1 agreement of logits [T, V]."""
    kls = []
    # float64 in chunks of positions: a [T, V] float64 copy of a 150k vocabulary is large.
    for start in range(0, ref.shape[0], chunk):
        lp = _log_softmax(ref[start:start + chunk].astype(np.float64))
        lq = _log_softmax(ours[start:start + chunk].astype(np.float64))
        kls.append(np.sum(np.exp(lp) * (lp - lq), axis=-1))
    kl = np.maximum(np.concatenate(kls), 0.0)  # rounding can make a zero KL slightly negative
    err = float(np.max(np.abs(ours.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    return {
        "max_abs_err": err,
        "ref_max_abs": scale,
        "rel_err": err / scale if scale > 0 else err,
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float(np.mean(ref.argmax(-1) == ours.argmax(-1))),
    }


def compare(ref_layers: Sequence[np.ndarray], ref_logits: np.ndarray, our_layers: Sequence[np.ndarray],
            our_logits: np.ndarray, tol: Tolerance = Tolerance()) -> Report:
    """Compare per-layer outputs [T, D] and logits [T, V] of the reference and dayzero."""
    if len(ref_layers) != len(our_layers):
        raise VerifyError(
            f"the reference has {len(ref_layers)} decoder layers and the conversion {len(our_layers)}; "
            "verify DST against the checkpoint it was converted from"
        )
    rows = _layer_rows(ref_layers, our_layers, tol)
    stats = logits_stats(ref_logits, our_logits)
    bad = next((r.layer for r in rows if not r.within_tolerance), None)
    jump = next((r.layer for r in rows if r.jump), None)
    failures = []
    if bad is not None:
        row = rows[bad]
        failures.append(f"layer {bad} (model.layers.{bad}) is the first beyond tolerance: relative error "
                        f"{row.rel_err:.3g} > rtol {tol.rtol:g}")
        if jump is not None and jump < bad:
            failures.append(f"its error first jumped at layer {jump}")
    if stats["top1_agreement"] < tol.min_top1:
        failures.append(f"top-1 agreement {stats['top1_agreement']:.4f} < {tol.min_top1:g}")
    if stats["kl_max"] > tol.max_kl:
        failures.append(f"max KL {stats['kl_max']:.3g} > {tol.max_kl:g}")
    return Report(len(ref_logits), rows, stats, bad, jump, failures, tol)


# --- running the two models --------------------------------------------------------------------------


def _decoder_layers(model: Any) -> Sequence[Any]:
    """The decoder layer modules of an HF causal LM (``model.model.layers`` in every family so far)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise VerifyError(
            f"cannot find the decoder layers of {type(model).__name__}; verify supports *ForCausalLM models"
        )
    return layers


def _load_state_dict_model(src: Path) -> Any:
    """An HF model built from the config.json beside a bare PyTorch state dict, then filled from it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src.parent)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = torch.load(src, map_location="cpu", mmap=True, weights_only=True)
    missing, _ = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed:
        raise VerifyError(f"{src} lacks tensor '{sorted(set(missing) - allowed)[0]}'; pass the full state dict")
    return model


def load_reference(src: Path) -> Any:
    """The original checkpoint as an HF transformers model in fp32, eager attention, eval mode."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise VerifyError(
            "dayzero verify needs transformers and torch to run the reference; install the test extras "
            "(pip install 'dayzero[test]')"
        ) from None
    if not (src.is_dir() or src.suffix == ".gguf" or src.suffix in TORCH_SUFFIXES):
        raise VerifyError(f"cannot tell what reference {src} is; pass an HF directory, a .bin/.pt/.pth or a .gguf file")
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    transformers.utils.logging.disable_progress_bar()  # its loading bar would clutter the report
    try:
        if src.is_dir():
            model = _from_directory(src, kwargs)
        elif src.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, **kwargs)
        else:
            model = _load_state_dict_model(src)
    except VerifyError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        # transformers reports an unusable checkpoint with any of these; the first line says why.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VerifyError(
            f"transformers cannot load reference {src} ({first}); pass the checkpoint DST was converted from"
        ) from None
    return model.eval()


def _from_directory(src: Path, kwargs: dict) -> Any:
    """An HF directory as a causal LM, or (a multimodal composite such as Qwen3-VL-MoE, which has
    no causal-LM class) as an image-text-to-text model, run on text."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(src))
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText.from_pretrained(str(src), **kwargs)
    return AutoModelForCausalLM.from_pretrained(str(src), **kwargs)


def run_reference(src: Path, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """HF transformers on ``ids``: each decoder layer's raw output [T, D] and the logits [T, V]."""
    import torch

    model = load_reference(src)
    outputs: list[np.ndarray] = []

    def record(_module, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        outputs.append(out[0].detach().float().numpy().copy())

    hooks = [layer.register_forward_hook(record) for layer in _decoder_layers(model)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy().copy()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, logits


def run_dayzero(dst: Path, ids: list[int], placement: Any = None) -> tuple[list[np.ndarray], np.ndarray]:
    """dayzero's ``forward`` (fp32, jitted, no cache) on ``ids``: per-layer outputs and logits.

    ``placement`` (a ``dayzero.sharding.placement.Placement``): run sharded over its mesh, the
    weights restored straight into their shardings, the outputs gathered whole.
    """
    import jax
    import jax.numpy as jnp

    from dayzero.convert import load_checkpoint
    from dayzero.convert.checkpoint import read_config, read_manifest, stored_quantization
    from dayzero.model.transformer import forward
    from dayzero.model.weights import abstract_weights

    shardings = parallel = None
    tokens = np.asarray([ids], np.int32)
    if placement is not None:
        from dayzero.engine.runtime import resolve_run

        config, stored = read_config(dst), stored_quantization(read_manifest(dst))
        # fp32 on the reference path, as stored: the mesh's other choices from the one resolver.
        parallel = resolve_run(config, dtype=jnp.float32, stored=stored, kernels="reference",
                               placement=placement).parallel
        shardings = placement.shardings(abstract_weights(config, stored))
        tokens = placement.replicate(tokens)
    config, weights = load_checkpoint(dst, jnp.float32, shardings)

    def run(weights, config, tokens):
        hidden: list = []  # filled during tracing and returned, so no tracer escapes the jit
        logits, _ = forward(weights, config, tokens, cache=None, all_logits=True, hidden_out=hidden,
                            parallel=parallel)
        if placement is not None:  # whole on every device, so every process can read them
            return jax.lax.with_sharding_constraint((logits, hidden), placement.replicated())
        return logits, hidden

    logits, hidden = jax.jit(run, static_argnums=1)(weights, config, tokens)
    return [np.asarray(h[0]) for h in hidden], np.asarray(logits[0])


def prompt_ids(dst: Path, text: str | None, ids: list[int] | None, vocab_size: int) -> list[int]:
    """The prompt as token ids: given ids, or ``text`` (default: DEFAULT_PROMPT) encoded by DST's tokenizer."""
    if ids is None:
        from dayzero.engine.tokenizer import Tokenizer

        if not (dst / "tokenizer.json").is_file():
            raise VerifyError(
                f"{dst} has no tokenizer.json to encode the prompt; pass token ids with --prompt-ids 1,2,3"
            )
        ids = Tokenizer(dst).encode(DEFAULT_PROMPT if text is None else text)
    if not ids:
        raise VerifyError("the prompt is empty; pass a non-empty --prompt or --prompt-ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise VerifyError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}); pass valid ids")
    return list(ids)


def verify(src: str | Path, dst: str | Path, text: str | None = None, ids: list[int] | None = None,
           tol: Tolerance = Tolerance(), placement: Any = None) -> Report:
    """Run the reference and the conversion on one prompt and compare them (see the module docstring).

    The reference runs first and is freed before the conversion is loaded, so the peak holds one
    model, not two.
    """
    from dayzero.convert.checkpoint import read_manifest

    src, dst = Path(src), Path(dst)
    manifest = read_manifest(dst)  # a clear error for a DST that is not a conversion
    if not src.exists():
        raise VerifyError(f"reference {src} does not exist; pass the HF directory or .gguf file DST was converted from")
    tokens = prompt_ids(dst, text, ids, int(manifest["config"]["vocab_size"]))
    ref_layers, ref_logits = run_reference(src, tokens)
    gc.collect()
    our_layers, our_logits = run_dayzero(dst, tokens, placement)
    return compare(ref_layers, ref_logits, our_layers, our_logits, tol)


# --- output ---------------------------------------------------------------------------------------------


def format_table(report: Report) -> str:
    """The human-readable table: one row per layer, then the logits."""
    lines = [f"{'layer':>5}  {'max_abs_err':>11}  {'max|ref|':>9}  {'rel_err':>9}  {'growth':>8}  status"]
    for r in report.layers:
        growth = f"{r.growth:8.3g}x" if r.growth is not None else f"{'-':>9}"
        status = "ok" if r.within_tolerance else "FAIL"
        if r.jump:
            status += "  <- jump"
        lines.append(f"{r.layer:>5}  {r.max_abs_err:11.3e}  {r.ref_max_abs:9.3e}  {r.rel_err:9.3e} {growth}  {status}")
    s = report.logits
    lines.append(f"logits: max_abs_err {s['max_abs_err']:.3e} (rel {s['rel_err']:.3e})  "
                 f"KL mean {s['kl_mean']:.3e} max {s['kl_max']:.3e}  top-1 agreement {s['top1_agreement']:.4f}")
    bad = report.first_bad_layer
    first = "none" if bad is None else f"{bad} (model.layers.{bad})"
    jump = "none" if report.first_jump_layer is None else str(report.first_jump_layer)
    lines.append(f"first bad layer: {first}; first jump: {jump}")
    return "\n".join(lines)


def run_verify(args: Any, ids: list[int] | None, placement: Any = None) -> int:
    """``dayzero verify`` with parsed arguments: 0 when within tolerance, 1 (verdict on stderr) when not."""
    for name in ("rtol", "atol", "max_kl"):
        if getattr(args, name) < 0:
            raise VerifyError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0")
    if not 0 <= args.min_top1 <= 1:
        raise VerifyError(f"--min-top1 {args.min_top1} must be between 0 and 1")
    tol = Tolerance(args.rtol, args.atol, args.max_kl, args.min_top1)
    report = verify(args.reference, args.model, args.prompt, ids, tol, placement)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"dayzero verify: {args.model} against {args.reference}, {report.num_tokens} prompt tokens, fp32")
        print(format_table(report))
        if report.passed:
            print(report.verdict())
    if not report.passed:
        print(f"dayzero verify: {report.verdict()}", file=sys.stderr)
        return 1
    return 0
