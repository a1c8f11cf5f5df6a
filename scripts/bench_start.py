"""Start-up memory per rank: the meta start (the trainer's) against the old materialize-everything start.

    python3 scripts/bench_start.py                       # llama3 1B shapes, 4 of its 16 layers, 4 gloo ranks
    python3 scripts/bench_start.py --layers 16           # the whole 1B (the old start needs ~4 GiB per rank)

Both starts run in one invocation, one after the other, each in its own ``--ranks`` gloo processes (FSDP2 + DMuon
over all of them, the byte vocabulary, fp32). In every rank the peak resident memory is reset after the imports,
the process group and a throwaway meta build of a tiny flavor (the first meta build loads ~100 MiB of torch's
Python code, the same for both starts) (``/proc/self/clear_refs``), and the start is measured above that baseline
(``VmHWM``):

  new   the trainer's start: the meta model -> parallelize (TP, DMuon's dedicate_params, FSDP2, all on meta)
        -> materialize (each rank allocates and initializes its FSDP2 shards, its owner column's fp32 masters,
        the buffers, from titan_dmuon/components/initialization.py);
  old   build on meta -> ``to_empty`` + ``init_weights`` of the whole model on every rank -> parallelize (DMuon
        copies the owners' masters out of the live values, FSDP2 shards the live params).

Next to them: the bytes of the tensors the rank holds after the new start (its share) and the largest matrix.
The new start must stay within share + largest matrix. One summary line: ``bench_start: ...``.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import socket
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MIB = 2.0**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def _held_bytes(model, optimizer_component) -> float:
    """Bytes of the tensors this rank holds: local shards of the params (the dedicated ones: the fp32 master
    that every rank of a matrix's owner column keeps, `in_owner_column`, of its local size `numel`), and the
    buffers."""
    from torch.distributed.tensor import DTensor

    from titan_dmuon import dmuon

    dps = dmuon.get_dedicated_params(model)
    own = {dp.param for dp in dps}
    total = sum(dp.numel * 4 for dp in dps if dp.in_owner_column)
    for p in model.parameters():
        if p not in own:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return float(total + sum(b.numel() * b.element_size() for b in model.buffers()))


def _rank(rank: int, world: int, port: int, mode: str, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from titan_dmuon.components.initialization import materialize
    from titan_dmuon.components.model import get_model_spec
    from titan_dmuon.components.optimizer import build_optimizer_component
    from titan_dmuon.config import parse_args
    from titan_dmuon.parallel import ParallelDims, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = parse_args(["--config", "train_configs/debug_model.toml", "--model.flavor", args.flavor])
    cfg.training.seq_len = args.seq_len
    spec = get_model_spec("llama3")
    component = build_optimizer_component(cfg, spec)
    dims = ParallelDims.from_config(cfg, world)
    mesh = dims.build_mesh("cpu")
    device = torch.device("cpu")
    spec.build("tinymodel", vocab_size=258)  # warm-up: the first meta build imports ~100 MiB of torch's Python decomps
    gc.collect()
    baseline = _status_kib("VmRSS")
    _reset_peak()

    model = spec.build(args.flavor, vocab_size=258, max_seq_len=args.seq_len, n_layers=args.layers)
    largest = max(p.numel() for p in model.parameters()) * 4.0
    if mode == "new":  # the trainer's start (titan_dmuon/trainer.py, steps 6-7b)
        model = parallelize(model, dims, mesh, cfg, spec, component)
        materialize(model, spec, component, device, seed=0)
    else:  # the old start: every rank materializes and initializes the whole model, then parallelizes it
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.init_weights(buffer_device=device)
        model = parallelize(model, dims, mesh, cfg, spec, component)
    gc.collect()
    peak = (_status_kib("VmHWM") - baseline) * 1024.0
    result = {"peak": peak, "held": _held_bytes(model, component), "largest": largest}
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"{mode}{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, args) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(args.ranks, _free_port(), mode, args, out), nprocs=args.ranks, start_method="spawn"
        )
        results = []
        for r in range(args.ranks):
            with open(os.path.join(out, f"{mode}{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="1B", help="llama3 flavor whose shapes to build (default 1B)")
    parser.add_argument("--layers", type=int, default=4, help="blocks to build (default 4 of the 1B's 16)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048, help="RoPE table length")
    args = parser.parse_args()
    os.chdir(REPO)
    new, old = run("new", args), run("old", args)
    print(f"llama3 {args.flavor} shapes, {args.layers} layers, byte vocab, fp32, {args.ranks} gloo ranks")
    header = f"{'rank':>4} {'share':>10} {'largest':>10} {'new peak':>10} {'old peak':>10}  new <= share + largest"
    print(header + "   (MiB above each rank's baseline)")
    ok = True
    for r, (n, o) in enumerate(zip(new, old, strict=True)):
        fits = n["peak"] <= n["held"] + n["largest"]
        ok &= fits
        print(
            f"{r:>4} {n['held'] / MIB:>10.1f} {n['largest'] / MIB:>10.1f} {n['peak'] / MIB:>10.1f} "
            f"{o['peak'] / MIB:>10.1f}  {'yes' if fits else 'NO'}"
        )
    worst_new = max(n["peak"] - n["held"] for n in new)
    ratio = max(o["peak"] for o in old) / max(n["peak"] for n in new)
    print(
        f"bench_start: new peak <= share + largest matrix on every rank: {'yes' if ok else 'NO'} | worst new peak - "
        f"share {worst_new / MIB:.1f} MiB (largest matrix {new[0]['largest'] / MIB:.1f} MiB) | old/new peak "
        f"{ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
