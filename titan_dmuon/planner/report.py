"""The plan in words: `format_plan` prints every section of `plan()`'s dict, `format_capacity` the verdict against
the device (and, when it does not fit, the largest terms and the changes that would fit)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .communication import FORMULA_OF_KIND
from .memory import ACTIVATION_TERMS, WARN_FRACTION
from .summary import GIB, MIB


def format_capacity(p: dict[str, Any]) -> str:
    """The plan's verdict against the device: fits, fits but close (a warning), or does not fit, with its largest
    terms and the changes that would fit."""
    cap = p["capacity"]
    device, peak = cap["device_bytes"], cap["peak_bytes"]
    head = f"{peak / GIB:.1f} GiB planned on rank {cap['rank']} of a {device / GIB:g} GiB device"
    if cap["fits"] and not cap["warn"]:
        return f"Fits: {head} ({100 * peak / device:.0f}%)."
    if cap["fits"]:
        return (
            f"WARNING: fits, but close: {head} ({100 * peak / device:.0f}%, above {100 * WARN_FRACTION:.0f}%): "
            "fragmentation and the framework's own buffers may not fit in the rest."
        )
    lines = [f"Does not fit: {head}. The largest terms:"]
    lines += [f"  {label:<48} {value / GIB:10.1f} GiB" for label, value in cap["largest_terms"]]
    if cap["alternatives"]:
        lines.append("Each of these changes alone, planned (--job.dry_run_device_memory_gib sets the device):")
        lines += [
            f"  {a['change']:<88} {a['peak_bytes'] / GIB:8.1f} GiB  {'fits' if a['fits'] else 'does not fit'}"
            for a in cap["alternatives"]
        ]
    return "\n".join(lines)


def format_pipeline(pipe: dict[str, Any] | None) -> list[str]:
    """The pipeline section: the schedule, its bubble, and per pp rank its stages, peak, activations (with the
    microbatches in flight), what it sends its neighbours and DMuon's bytes."""
    if not pipe:
        return []
    lines = [
        "",
        f"Pipeline {pipe['schedule']}: {pipe['stages']} stages ({pipe['stages_per_rank']} per rank), "
        f"{pipe['microbatches']} microbatches of {pipe['microbatch_size']} rows a step, bubble "
        f"{100 * pipe['bubble_fraction']:.1f}% (equal stages; docs/training.md), "
        f"{pipe['activation_bytes_per_microbatch'] / MIB:.2f} MiB per microbatch and stage boundary",
        f"  {'pp rank: stages (modules)':<58} {'peak':>9} {'activations (in flight)':>24} {'p2p sent':>10} "
        f"{'DMuon':>9}",
    ]
    for r in pipe["ranks"]:
        held = "; ".join(f"{i}: {_modules(mods)}" for i, mods in r["stages"].items())
        lines.append(
            f"  {r['pp_rank']:>3}: {held[:52]:<53} {r['peak_bytes'] / GIB:7.2f} G "
            f"{r['activations_bytes'] / GIB:9.2f} G ({r['microbatches_in_flight']:5.2f} mb) "
            f"{r['p2p_send_bytes'] / GIB:8.3f} G {r['dmuon_bytes'] / GIB:7.3f} G"
            + ("  no Muon matrix" if r["muon_matrices"] == 0 else "")
        )
    lines += [f"  WARNING: {w}" for w in pipe.get("warnings", [])]
    return lines


def _modules(mods: list[str]) -> str:
    """A stage's modules in short: its blocks as a range, the embedding and the head by name."""
    blocks = [int(m.split(".")[1]) for m in mods if m.startswith("layers.")]
    out = ["embed"] if "tok_embeddings" in mods else []
    if blocks:
        out.append(f"layers {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"layer {blocks[0]}")
    if "output" in mods:
        out.append("head")
    return ", ".join(out)


def _row(label: str, s: dict | None, scale: float, unit: str, width: int = 46) -> str:
    if s is None:
        return f"  {label:<{width}} {'(no estimate for this family)':>36}"
    return f"  {label:<{width}} {s['min'] / scale:>10.3f} {s['median'] / scale:>11.3f} {s['max'] / scale:>11.3f} {unit}"


def format_plan(p: dict[str, Any]) -> str:
    c, mem, lpt, comm = p["config"], p["memory_bytes"], p["lpt"], p["bytes_per_step"]
    mesh, ep = c["mesh"], c.get("expert_parallel")
    in_shard = f" (efsdp {ep['efsdp']} x ep {ep['ep']})" if ep else ""
    pp = f"pp {mesh['pp']} x " if mesh.get("pp", 1) > 1 else ""
    lines = [
        f"Dry run: {c['model']}, {c['params']:,} params (vocab: {c['vocab']}), world {c['world_size']} = {pp}replicate "
        f"{mesh['replicate']} x shard {mesh['shard']}{in_shard} x tp {mesh['tp']} (fake process group, meta tensors)",
        f"  micro-batch {c['local_batch_size']} x {c['seq_len']} tokens per DP rank, AC {c['activation_checkpoint']}, "
        f"params {c['param_dtype']} / reduce {c['reduce_dtype']}, DMuon-{c['dmuon_mode']}, "
        f"FSDP2 reshard {c['fsdp_reshard_after_forward']}" + (", loss parallel" if c["loss_parallel"] else ""),
        "",
        p["layout"],
        *format_pipeline(p.get("pipeline")),
        "",
        f"  {'memory per rank':<46} {'min':>10} {'median':>11} {'max':>11}"
        + ("  (the largest pipeline stage's ranks)" if p.get("pipeline") else ""),
    ]
    unit, scale = ("GiB", GIB) if mem["peak_estimate"]["max"] >= GIB else ("MiB", MIB)
    labels = [
        ("fsdp_param_shards", "FSDP2 param shards (fp32)"),
        ("dmuon_fp32_masters", "DMuon fp32 masters (owner column)" if not ep else "DMuon fp32 masters (owner columns)"),
        ("muon_momentum", "Muon momentum (global owner, fp32)"),
        ("adamw_moments", "AdamW moments (FSDP2 params)"),
        ("gradients", "gradients (FSDP2 shards + owners' reduced)"),
        ("resident_total", "resident total"),
        ("dmuon_packed_transient_peak", f"DMuon packed buffers, {c['dmuon_mode']} transient peak"),
        ("fsdp_root_unsharded", "FSDP2 root unit gathered (params + grads)"),
        ("activations_estimate", f"activations (estimate, AC {c['activation_checkpoint']})"),
        ("peak_estimate", "peak (resident + transients + activations)"),
    ]
    lines += [_row(label, mem[key], scale, unit) for key, label in labels]
    if mem["activation_terms"] is not None:
        act = mem["activation_terms"]
        lines.append(
            "    of which: "
            + ", ".join(f"{ACTIVATION_TERMS[k]} {act[k] / scale:.3f}" for k in ACTIVATION_TERMS)
            + f" {unit} (the peak: blocks + max(head + its grads, recompute))"
        )
    lo = lpt["owners_per_layer"]
    first = ", ".join(
        (
            f"{'.'.join(fqn.rsplit('.', 2)[-2:])}->e({o['owner_shard']},{o['owner_replicate']})"
            if o.get("expert")
            else f"{fqn.rsplit('.', 2)[-2]}->({o['owner_shard']},{o['owner_replicate']}"
            + (f",tp{o['tp_owner']})" if mesh["tp"] > 1 else ")")
        )
        for fqn, o in lpt["first_layer"].items()
    )
    stacks = lpt.get("expert_stacks", 0)
    expert_slots = (
        f"; {stacks} of them expert stacks over {lpt['expert_slots']} expert slots (expert shard x replicate, each "
        f"stack's NS on its owner's {ep['ep'] if ep else 1} EP ranks; per expert slot max/bound "
        f"{lpt['expert_slot_max_over_lower_bound']:.3f})"
        if stacks
        else ""
    )
    ns = lpt["ns_flops_per_rank"]
    naive, adamw = comm["naive_fsdp2_muon_bytes"], comm["fsdp2_adamw_bytes"]
    bunit, bscale = ("GiB", GIB) if naive["total"] >= GIB else ("MiB", MIB)
    lines += [
        "",
        f"LPT plan: {lpt['matrices']} matrices in {lpt['layers']} layers over {lpt['slots']} DP owner slots "
        f"(shard x replicate){' x tp ' + str(mesh['tp']) if mesh['tp'] > 1 else ''}, NS {lpt['ns_steps']} steps"
        + expert_slots,
        f"  NS TFLOP per rank and step: max {ns['max'] / 1e12:.3f}, mean {lpt['ns_flops_mean'] / 1e12:.3f} "
        f"(max/mean {lpt['max_over_mean']:.3f}); certified lower bound {lpt['ns_flops_lower_bound'] / 1e12:.3f} "
        f"(max/bound {lpt['max_over_lower_bound']:.3f}; per DP slot {lpt['slot_max_over_lower_bound']:.3f})",
        f"  distinct owners per layer: min {lo['min']}, median {lo['median']:g}, max {lo['max']} "
        f"(of {lo['matrices_per_layer']} matrices); first layer (shard,replicate"
        + ("; e: expert shard,replicate" if stacks else "")
        + f"): {first}",
        f"  owner NS time per step at {lpt['tflops']:g} TFLOP/s: max {lpt['ns_time_s_max'] * 1e3:.2f} ms, "
        f"mean {lpt['ns_time_s_mean'] * 1e3:.2f} ms (naive FSDP2 + Muon: every rank runs all "
        f"{lpt['naive_ns_flops_per_rank'] / 1e12:.2f} TFLOP = {lpt['naive_ns_time_s'] * 1e3:.1f} ms)",
        "",
        f"Bytes per step per rank ({bunit}), the Muon matrices: P_M = {comm['p_m_elements']:,.0f} elements per TP rank"
        + (
            f"; expert stacks over the expert shard groups of G_e = {comm['expert_shard_group']} ranks: "
            f"P_E/EP = {comm['p_e_elements']:,.0f} elements per EP rank"
            if comm.get("expert_stacks")
            else ""
        ),
        f"  {'DMuon ledger kind':<46} {'min':>10} {'median':>11} {'max':>11}",
    ]
    fe = comm["formula_elements"]
    for kind, s in comm["dmuon_bytes"].items():
        if s["max"] == 0:
            continue
        lines.append(_row(kind, s, bscale, bunit))
    lines.append(_row("DMuon total", comm["dmuon_total_bytes"], bscale, bunit))
    if comm.get("tp_paths"):
        paths = list(comm["tp_paths"].values())
        lines.append(
            f"  TP paths (tp_distributed_gram={comm['tp_distributed_gram']}, policy "
            f"{comm['tp_distributed_gram_policy']!r}): "
            + ", ".join(f"{path} {paths.count(path)}" for path in ("gram", "gather", "local") if path in paths)
            + " matrices (the start-up log prints each one's and why)"
        )
    ok = all(
        np.allclose(comm["dmuon_elements"][k]["per_rank"], fe[f]["per_rank"], rtol=1e-12, atol=0)
        for k, f in FORMULA_OF_KIND.items()
    )
    z = "2" if c["dmuon_mode"] == "Z3" else ""
    experts = (
        f'; the expert stacks\' (docs/dmuon.md, "Experts") added: broadcast {z}(G_e-1)/G_e P_E/EP, reduce '
        "(G_e-1)/G_e (P_E/EP + M_E), replicate_* (R-1)/R of the expert column's"
        if comm.get("expert_stacks")
        else ""
    )
    lines.append(
        f"  formulas (docs/dmuon.md): broadcast {z}(N-1)/N P_M, reduce (N-1)/N (P_M + M), replicate_* (R-1)/R "
        f"P_col(shard) (+ M_col){experts}: {'equal' if ok else 'DIFFERENT'}"
    )
    lines += [
        f"  {'naive FSDP2 + Muon':<46} {naive['total'] / bscale:>34.3f} {bunit}  (all-gather "
        f"{naive['all_gather'] / bscale:.2f} + reduce-scatter {naive['reduce_scatter'] / bscale:.2f} + replicate "
        f"all-reduce {naive['replicate_all_reduce'] / bscale:.2f} + grad all-gather "
        f"{naive['grad_all_gather'] / bscale:.2f}; NS on every rank)",
        f"  {'FSDP2 + AdamW':<46} {adamw['total'] / bscale:>34.3f} {bunit}  (all-gather, reduce-scatter, replicate "
        "all-reduce)",
        _row("other params (FSDP2: embeddings, norms, output)", comm["other_params_fsdp2_bytes"], bscale, bunit),
    ]
    a2a = comm.get("moe_all_to_all")
    if a2a is not None:
        lines.append(
            f"  {'MoE all-to-all (tokens; every optimizer)':<46} {a2a['total'] / bscale:>34.3f} {bunit}  (EP "
            f"{a2a['ep']}, uniform routing: {a2a['moe_layers']} MoE layers x {a2a['tokens_per_rank']:,} tokens x "
            f"top-{a2a['top_k']} x {a2a['dim']} x {a2a['element_bytes']} B x (EP-1)/EP, 4 ways = "
            f"{a2a['bytes'] / bscale:.2f} + AC recompute of {a2a['recomputed_layers']} layers "
            f"{a2a['ac_recompute_bytes'] / bscale:.2f} + expert counts {a2a['counts_bytes'] / bscale:.4f})"
        )
    lines += [
        "",
        f"Planned in {p['planner']['seconds']:.1f} s, {p['planner']['max_rss_bytes'] / GIB:.2f} GiB RSS",
    ]
    return "\n".join(lines)
