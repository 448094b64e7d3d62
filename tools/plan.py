"""``dayzero plan``: per-device memory and collectives of a model on N devices, the mesh to use,
and whether it fits.

Glue between the command line, the model's abstract declarations (``dayzero.model.footprint``)
and the planner's arithmetic (``dayzero.sharding.planner``). No jax device is touched.
"""

from __future__ import annotations

import argparse
import json

from dayzero.model.config import ModelConfig
from dayzero.sharding.distributed import parse_mesh
from dayzero.sharding.planner import RULE, MeshPlan, Plan, Workload, format_size, parse_size, plan

# Candidate meshes listed after the recommendation in the text report.
SHOWN_CANDIDATES = 8
LARGEST = 3  # collectives listed per step in the text report
OPS = (("all_reduce", "all-reduce"), ("all_gather", "all-gather"), ("all_to_all", "all-to-all"))


def load_model(preset: str | None, config_path: str | None) -> tuple[str, ModelConfig]:
    """The model named by ``--preset`` or read from ``--config`` (an HF config.json or its directory)."""
    from dayzero.model.hf_config import load_hf_config
    from dayzero.model.presets import load_preset

    if preset is not None:
        return preset, load_preset(preset)
    return str(config_path), load_hf_config(config_path)


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` of ``--devices --device-memory --quantize --kv-cache --dtype --batch
    --context --prefill-chunk --devices-per-host --kernels --host-memory --host-bandwidth
    --micro-batches``, its storage checked with the engine's parsers before any model is built."""
    from dayzero.model.footprint import storage

    work = Workload(
        devices=args.devices, device_memory=parse_size(args.device_memory), quantize=args.quantize,
        kv_cache=args.kv_cache, dtype=args.dtype, batch=args.batch, context=args.context,
        prefill_chunk=args.prefill_chunk, devices_per_host=args.devices_per_host,
        reserve=getattr(args, "reserve", 0.1), kernels=getattr(args, "kernels", "auto"),
        state_snapshots=getattr(args, "state_snapshots", None),  # as ``dayzero serve --state-snapshots``
        host_memory=_size_or_none(getattr(args, "host_memory", None), "--host-memory"),
        host_bandwidth=float(parse_size(getattr(args, "host_bandwidth", None) or "55GB", "--host-bandwidth")),
        micro_batches=getattr(args, "micro_batches", None),
    )
    storage(work)
    return work


def _size_or_none(text: str | None, what: str) -> int | None:
    return None if text is None else parse_size(text, what)


def make_plan(args: argparse.Namespace) -> Plan:
    """Plan the model and workload the command line describes."""
    return _plan_and_config(args)[0]


def _plan_and_config(args: argparse.Namespace) -> tuple[Plan, ModelConfig]:
    from dayzero.model.footprint import DecodeFootprint

    work = workload_from_args(args)  # checked before the (slower) model is built
    name, config = load_model(args.preset, args.config)
    return plan(DecodeFootprint(config, name), work, parse_mesh(args.mesh) or None), config


def run_plan(args: argparse.Namespace) -> int:
    """``dayzero plan``: print the plan (one JSON object with ``--json``); exit 1 if it does not fit."""
    result, config = _plan_and_config(args)
    print(json.dumps(result.to_json()) if args.json else format_plan(result, kv_layout(config, result.page_size)))
    return 0 if result.fits else 1


def _row(p: MeshPlan) -> str:
    mesh = f"  {p.to_json()['mesh_text']:<28} "
    if not p.runs:
        return mesh + f"refused: {p.refused}"
    b = p.bytes
    # The KV column: the pools, their scales and the prefix cache's state snapshots (all cache memory).
    weights, kv = b["weights"] + b["weight_scales"], b["kv_cache"] + b["kv_scales"] + b["state_snapshots"]
    return (mesh + f"{format_size(weights):>10} {format_size(kv):>10} "
            f"{format_size(b['activations']):>10} {format_size(p.total):>10} {format_size(p.inter_host):>10}  "
            f"{'yes' if p.tensor_in_host else 'no':<7} {f'{p.bubble:.0%}' if p.stages else '-':>6}  "
            f"{'yes' if p.fits else 'with host' if p.fits_with_host else 'no'}")


def _collective_lines(p: MeshPlan, step: str, label: str) -> list[str]:
    """One step's bytes sent per op and across hosts, then its largest collectives."""
    sent, inter_host = (p.collectives, p.inter_host) if step == "decode" else (p.collectives_prefill,
                                                                               p.inter_host_prefill)
    ops = ", ".join(f"{text} {format_size(sent[op])}" for op, text in OPS)
    largest = sorted((d for d in p.detail if d["step"] == step), key=lambda d: -d["bytes"])[:LARGEST]
    return [f"  {label:<18} {ops}; across hosts {format_size(inter_host)}"] + [
        f"      {format_size(d['bytes']):>10}  {d['op'].replace('_', '-')} over {d['mesh_axis']}={d['group']}"
        f"{' (across hosts)' if d['inter_host'] else ''}: {d['name']}" for d in largest]


def kv_layout(config: ModelConfig, page: int) -> str:
    """How the serving engine holds the KV planned: page pools of ``page`` positions a page (the
    plan's, ``Plan.page_size``); a hybrid's pages are its attention layers', beside its linear
    layers' states per sequence; DeepSeek-V4's hold its compressed entries (a page size that is a
    multiple of its ratios) beside window rings and compressor states per sequence."""
    if config.compressed is not None:
        return f"serving page pools, {page} positions a page, and window rings and compressor states per sequence"
    if config.linear is not None:
        return f"serving page pools, {page} positions a page, and linear-layer states per sequence"
    return f"serving page pools, {page} positions a page"


def _snapshot_line(result: Plan, rows: int) -> list[str]:
    """The prefix cache's state snapshots, where the plan holds any: bytes per device, rows, and
    what one row costs."""
    size = result.recommended.bytes["state_snapshots"]
    if not size:
        return []
    n = result.work.snapshot_rows(rows)
    return [f"  snapshots    {format_size(size):>10}  (the prefix cache's copies of per-sequence states: {n} rows, "
            f"{n / rows:g} per sequence, {format_size(size // n)} each on each device)"]


def _pipeline_lines(p: MeshPlan, w) -> list[str]:
    """A stage mesh: its stages' layers, micro-batches and bubble, what crosses each boundary,
    and what ``model.pipeline`` does not run yet."""
    if not p.stages:
        return []
    ranges = ", ".join(f"{a}-{b - 1}" for a, b in p.stages)
    lines = [f"  pipeline: {len(p.stages)} stages (layers {ranges}), {p.micro_batches} micro-batches "
             f"(--micro-batches), bubble (S-1)/(M+S-1) = {p.bubble:.0%}; per device to the next stage "
             f"{format_size(p.stage_send[0])} per decode step, {format_size(p.stage_send[1])} per prefill chunk, "
             f"{'across' if p.stage_across_hosts else 'inside'} hosts"]
    if p.pipeline_gap:
        lines.append(f"  not run by the engine yet: {p.pipeline_gap}")
    return lines


def _host_lines(p: MeshPlan) -> list[str]:
    """The host tier: offloaded weights and their streaming time, KV swap space, per host."""
    h = p.host
    if h is None:
        return []
    lines = [f"  host tier: {format_size(h.host_bytes)} of {format_size(h.usable)} usable per host "
             f"({'fits' if h.fits else 'DOES NOT FIT'}); link {h.bandwidth / 1e9:g} GB/s per device",
             f"    KV swap space {format_size(h.swap_bytes)} per host (serve --swap-space default: the device pools); "
             f"one sequence back onto a device {format_size(h.swap_sequence_bytes)}, {h.swap_in_seconds * 1e3:.1f} ms"]
    if h.offload_layers:
        lines.append(f"    weights offloaded: {h.offload_layers} layers, {format_size(h.offload_bytes)} per device "
                     f"(+{format_size(h.buffer_bytes)} streaming buffer on the device), "
                     f"+{h.step_seconds * 1e3:.1f} ms per decode step streaming them"
                     f"{'' if p.fits_with_host else '; still does not fit'}")
    return lines


def format_plan(result: Plan, layout: str | None = None) -> str:
    """The human-readable report. ``layout``: how the KV is held (:func:`kv_layout`; default:
    page pools of ``result.page_size`` positions)."""
    w, best = result.work, result.recommended
    b = best.bytes
    rows = -(-w.batch // best.mesh["data"])  # the rows each device's replica holds
    layout = layout or f"serving page pools, {result.page_size} positions a page"
    lines = [
        f"{result.model}: {result.parameters / 1e9:,.1f}B parameters; {w.devices} devices x "
        f"{format_size(w.device_memory)} ({format_size(w.usable)} usable, {w.reserve:.0%} reserved), "
        f"{w.devices_per_host} per host; --quantize {w.quantize} --kv-cache {w.kv_cache} --dtype {w.dtype}; "
        f"batch {w.batch}, context {w.context}, prefill chunk {w.prefill_chunk}",
        "",
        f"{'mesh (given)' if result.forced else 'recommended mesh' if best.fits else 'no mesh fits; closest'}: "
        f"{best.to_json()['mesh_text']} ({best.strategy}) -- {'FITS' if best.fits else 'DOES NOT FIT'}, "
        f"{format_size(best.headroom) if best.fits else format_size(-best.headroom) + ' over'}"
        f"{' free' if best.fits else ''} per device; "
        f"tensor groups {'inside' if best.tensor_in_host else 'across'} hosts",
        f"  weights      {format_size(b['weights']):>10}" + (
            f"  + {format_size(b['weight_scales'])} quantization scales" if b["weight_scales"] else ""),
        f"  KV cache     {format_size(b['kv_cache']):>10}" + (
            f"  + {format_size(b['kv_scales'])} per-slot scales" if b["kv_scales"] else "")
        + f"  ({layout}; {format_size((b['kv_cache'] + b['kv_scales']) // rows)} per sequence on each device)",
        *_snapshot_line(result, rows),
        f"  activations  {format_size(b['activations']):>10}  (peak: {best.peak_stage})",
        f"    decode step of {w.batch} rows {format_size(best.activation_peaks['decode']):>10}; prefill chunk of "
        f"{min(w.prefill_chunk, w.context)} tokens {format_size(best.activation_peaks['prefill'])}",
        f"  total        {format_size(best.total):>10}",
        "  collectives sent per device (largest listed):",
        *_collective_lines(best, "decode", "per decode step"),
        *_collective_lines(best, "prefill", "per prefill chunk"),
        *_pipeline_lines(best, w),
        *_host_lines(best),
    ]
    if not result.forced:
        lines += ["", f"rule: {RULE}", "",
                  f"  {'mesh':<28} {'weights':>10} {'KV':>10} {'activ.':>10} {'total':>10} {'x-host/step':>10}  "
                  f"{'TP host':<7} {'bubble':>6}  fits"]
        lines += [_row(p) for p in result.candidates[:SHOWN_CANDIDATES]]
        if len(result.candidates) > SHOWN_CANDIDATES:
            lines.append(f"  ... {len(result.candidates) - SHOWN_CANDIDATES} more (--json lists all)")
    if result.advice:
        lines += ["", "what would fit:"] + [f"  - {a}" for a in result.advice]
    return "\n".join(lines)
