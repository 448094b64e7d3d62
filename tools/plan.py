"""``dayzero plan``: per-device memory of a model on N devices, the mesh to use, and whether it fits.

Glue between the command line, the model's abstract declarations (``dayzero.model.footprint``)
and the planner's arithmetic (``dayzero.sharding.planner``). No jax device is touched.
"""

from __future__ import annotations

import argparse
import json

from dayzero.model.config import ModelConfig
from dayzero.sharding.distributed import parse_mesh
from dayzero.sharding.planner import (
    RULE, KVDtype, MeshPlan, Plan, PlanError, WeightDtype, Workload, format_size, parse_size, plan,
)

# Candidate meshes listed after the recommendation in the text report.
SHOWN_CANDIDATES = 8


def load_model(preset: str | None, config_path: str | None) -> tuple[str, ModelConfig]:
    """The model named by ``--preset`` or read from ``--config`` (an HF config.json or its directory)."""
    from dayzero.model.hf_config import load_hf_config
    from dayzero.model.presets import load_preset

    if preset is not None:
        return preset, load_preset(preset)
    return str(config_path), load_hf_config(config_path)


def _enum(kind, value: str, flag: str):
    try:
        return kind(value)
    except ValueError:
        raise PlanError(f"{flag} {value!r} is not one of {', '.join(k.value for k in kind)}") from None


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` of ``--devices --device-memory --weight-dtype --kv-dtype --batch --context``."""
    return Workload(
        devices=args.devices, device_memory=parse_size(args.device_memory),
        weight_dtype=_enum(WeightDtype, args.weight_dtype, "--weight-dtype"),
        kv_dtype=_enum(KVDtype, args.kv_dtype, "--kv-dtype"),
        batch=args.batch, context=args.context, reserve=getattr(args, "reserve", 0.1),
    )


def make_plan(args: argparse.Namespace) -> Plan:
    """Plan the model and workload the command line describes."""
    from dayzero.model.footprint import DecodeFootprint

    work = workload_from_args(args)  # checked before the (slower) model is built
    name, config = load_model(args.preset, args.config)
    return plan(DecodeFootprint(config, name), work, parse_mesh(args.mesh) or None)


def run_plan(args: argparse.Namespace) -> int:
    """``dayzero plan``: print the plan (one JSON object with ``--json``); exit 1 if it does not fit."""
    result = make_plan(args)
    print(json.dumps(result.to_json()) if args.json else format_plan(result))
    return 0 if result.fits else 1


def _row(p: MeshPlan) -> str:
    b = p.bytes
    return (f"  {p.to_json()['mesh_text']:<28} {p.strategy:<24} {format_size(b['weights'] + b['weight_scales']):>10} "
            f"{format_size(b['kv_cache'] + b['kv_scales']):>10} {format_size(b['activations']):>10} "
            f"{format_size(p.total):>10}  {'yes' if p.fits else 'no'}")


def format_plan(result: Plan) -> str:
    """The human-readable report."""
    w, best = result.work, result.recommended
    b = best.bytes
    lines = [
        f"{result.model}: {result.parameters / 1e9:,.1f}B parameters; {w.devices} devices x "
        f"{format_size(w.device_memory)} ({format_size(w.usable)} usable, {w.reserve:.0%} reserved); "
        f"weights {w.weight_dtype.value}, KV {w.kv_dtype.value}; batch {w.batch}, context {w.context}",
        "",
        f"{'mesh (given)' if result.forced else 'recommended mesh' if best.fits else 'no mesh fits; closest'}: "
        f"{best.to_json()['mesh_text']} "
        f"({best.strategy}) -- {'FITS' if best.fits else 'DOES NOT FIT'}, "
        f"{format_size(best.headroom) if best.fits else format_size(-best.headroom) + ' over'}"
        f"{' free' if best.fits else ''} per device",
        f"  weights      {format_size(b['weights']):>10}" + (
            f"  + {format_size(b['weight_scales'])} fp8 block scales" if b["weight_scales"] else ""),
        f"  KV cache     {format_size(b['kv_cache']):>10}" + (
            f"  + {format_size(b['kv_scales'])} per-row scales" if b["kv_scales"] else ""),
        f"  activations  {format_size(b['activations']):>10}  (peak: {best.peak_stage})",
        f"  total        {format_size(best.total):>10}",
    ]
    if not result.forced:
        lines += ["", f"rule: {RULE}", "",
                  f"  {'mesh':<28} {'strategy':<24} {'weights':>10} {'KV':>10} {'activ.':>10} {'total':>10}  fits"]
        lines += [_row(p) for p in result.candidates[:SHOWN_CANDIDATES]]
        if len(result.candidates) > SHOWN_CANDIDATES:
            lines.append(f"  ... {len(result.candidates) - SHOWN_CANDIDATES} more (--json lists all)")
    if result.advice:
        lines += ["", "what would fit:"] + [f"  - {a}" for a in result.advice]
    return "\n".join(lines)
