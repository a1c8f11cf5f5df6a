"""Newton-Schulz time per matrix shape: direct vs Gram, one by one vs batched, torch vs Triton kernels.

For each distinct Muon matrix shape of Llama-3 8B and 70B (up to transposition: wq/wo, wk/wv, the FFN's
w1/w3/w2ᵀ) it times `--batch` matrices of that shape orthogonalized one by one (one NS call each) and as one
batched call (`orthogonalize_stack`, what an owner does with its same-shape matrices), in each formulation
("direct", "gram") and with each kernel that can run here ("torch"; "triton" on CUDA). Every configuration of
a shape runs once per round, round-robin, after a warm-up round; the time is the median over `--repeats`
rounds, per matrix. TFLOP/s counts the direct formulation's matmul FLOPs (newton_schulz.ns_flops) for every
row, so a Gram row shows its saving as a higher rate.

On CUDA the shapes are the real ones and NS runs in bf16; on CPU (fp32) they are divided by `--scale`
(default 16, so that the default run takes about a minute on two cores), and the Triton rows are left out:
Triton needs a GPU (its interpreter is for tests, not timing).

    python3 scripts/bench_ns.py                          # CPU: scaled shapes, batch 4, torch rows
    python3 scripts/bench_ns.py --scale 1 --repeats 1    # CPU: the real shapes (minutes per shape)
    python3 scripts/bench_ns.py --models 8B --batch 8    # on a GPU: real shapes, torch and Triton

`--check` first runs the Triton kernels on `--device` against float64 (the checks of
tests/unit/dmuon/test_ns_triton.py, which run them under the CPU interpreter, here on the real GPU: square, ragged,
tall, wide and batched/strided products in fp32/bf16/fp16, each operand precision, the full product, the whole NS
against the library's own torch backend in float64) and prints PASS/FAIL per check and what
`kernel="auto"` resolves to (`get_ns_backend`); on CPU it needs TRITON_INTERPRET=1. `--check-only` stops there.

Prints a table and one summary line `bench_ns ...: speed-up of gram over direct Ax, of batched over one-by-one Bx,
of triton over torch Cx` (time of the first over time of the second, summed over every shape).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from titan_dmuon.dmuon.newton_schulz import (  # noqa: E402
    default_ns_dtype,
    get_ns_backend,
    ns_flops,
    orthogonalize_stack,
    zeropower_via_newtonschulz,
)
from titan_dmuon.dmuon.ns_ops import resolve_kernel, triton_unusable  # noqa: E402

# (short, long) of each distinct Muon matrix of a Llama-3 block: dim, kv width (8 heads x 128), ffn hidden
LLAMA3 = {
    "8B": {"wq/wo": (4096, 4096), "wk/wv": (1024, 4096), "w1/w3/w2": (4096, 14336)},
    "70B": {"wq/wo": (8192, 8192), "wk/wv": (1024, 8192), "w1/w3/w2": (8192, 28672)},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _exact(g: torch.Tensor, coefficients: str) -> torch.Tensor:
    """The kernels' reference: the same NS on the torch backend in float64 (tests/ compare that backend with an
    independent NS)."""
    return zeropower_via_newtonschulz(g.double(), coefficients=coefficients, dtype=torch.float64, kernel="torch")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_kernels(device: torch.device) -> bool:
    """The Triton kernels on `device` against float64 references (tolerances of tests/unit/dmuon/test_ns_triton.py);
    prints one PASS/FAIL line per check and what kernel="auto" picks; True when every check passed."""
    from titan_dmuon.dmuon import kernels

    syrk, why = kernels.load()
    if syrk is None or triton_unusable(device, torch.float32):
        print(f"kernel check: SKIP ({why or triton_unusable(device, torch.float32)})")
        return True
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    checks: list[tuple[str, float, float]] = []  # (what, error, bound)
    shapes = {"square": (64, 64), "square-ragged": (150, 150), "tall": (150, 40), "wide": (40, 150)}
    shapes["ragged"] = (130, 200)
    big = not syrk.INTERPRETED  # GPU-sized cases only where they run at GPU speed
    if big:
        shapes["multi-tile"] = (300, 700)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, shape in shapes.items():
            x = randn(*shape, dtype=dtype)
            got = syrk.sym_matmul(x, out_dtype=torch.float32)
            err = _rel(got, x.double() @ x.double().T)
            # fp32 accumulation over k terms: the worst-case relative error bound grows as k * 2**-24
            checks.append((f"syrk {name} {shape} {str(dtype)[6:]}", err, max(1e-6, shape[1] * 2**-24)))
            checks.append((f"  symmetric {name} {str(dtype)[6:]}", float(not torch.equal(got, got.T)), 0.5))
        x = randn(3, 200, 70, dtype=dtype).mT
        got = syrk.sym_matmul(x, out_dtype=torch.float32)
        checks.append((f"syrk batched+strided {str(dtype)[6:]}", _rel(got, x.double() @ x.double().mT), 1e-6))
    rounders = {
        "bf16": lambda t: t.bfloat16().double(),
        "fp16": lambda t: t.half().double(),
        "ieee": lambda t: t.double(),
    }
    n = 150
    a = randn(2, n, 90)
    a = (a @ a.mT) / 90
    b = 0.5 * torch.eye(n, device=device) + 0.3 * a - 0.2 * (a @ a)
    b = (b + b.mT) / 2
    c = randn(2, n, n)
    c = c + c.mT
    for precision, rnd in rounders.items():
        got = syrk.sym_matmul(a, b, alpha=0.7, beta=-1.5, c=c, gamma=3.0, out_dtype=torch.float32, precision=precision)
        full = 0.7 * rnd(a) @ rnd(b) - 1.5 * c.double() + 3.0 * torch.eye(n, dtype=torch.float64, device=device)
        want = torch.tril(full) + torch.tril(full, -1).mT
        checks.append((f"symmetric product at {precision}", _rel(got, want), 1e-6))
    a, b, c = randn(2, 130, 130), randn(2, 130, 130), randn(2, 130, 130)
    got = syrk.sym_matmul(a, b, beta=0.5, c=c, gamma=2.0, out_dtype=torch.float32, symmetric=False)
    want = a.double() @ b.double().mT + 0.5 * c.double() + 2.0 * torch.eye(130, dtype=torch.float64, device=device)
    checks.append(("full product", _rel(got, want), 1e-6))
    for formulation in ("direct", "gram"):
        for coefficients in ("polar_express", "muon"):
            for shape in ((24, 72), (72, 24), (2, 40, 72)) + (((512, 1536),) if big else ()):
                G = randn(*shape)
                got = zeropower_via_newtonschulz(
                    G, coefficients=coefficients, dtype=torch.float32, formulation=formulation, kernel="triton"
                )
                err = max(
                    _rel(o, _exact(g, coefficients))
                    for g, o in zip(G.reshape(-1, *shape[-2:]), got.reshape(-1, *shape[-2:]), strict=True)
                )
                checks.append((f"NS fp32 triton {formulation} {coefficients} {shape}", err, 2e-5))
        G = torch.randn(40, 96, generator=torch.Generator().manual_seed(6)).to(device)  # the unit test's input
        exact = _exact(G, "polar_express")
        got = zeropower_via_newtonschulz(G, dtype=torch.bfloat16, formulation=formulation, kernel="triton")
        checks.append((f"NS bf16 triton {formulation} vs exact", _rel(got, exact), 3e-2))
    ok = True
    for what, err, bound in checks:
        good = err < bound  # NaN fails
        ok = ok and good
        print(f"kernel check {'PASS' if good else 'FAIL'} {what}: error {err:.2e} (bound {bound:g})")
    for dtype in (torch.bfloat16, torch.float32):
        for formulation in ("direct", "gram"):
            print(
                f"get_ns_backend({device.type}, {str(dtype)[6:]}, auto, {formulation}): "
                f"{get_ns_backend(device, dtype, 'auto', formulation)}; kernel='auto' resolves to "
                f"{resolve_kernel('auto', device, dtype)!r}"
            )
    print(f"kernel check: {'PASS' if ok else 'FAIL'} ({sum(e < b for _, e, b in checks)}/{len(checks)} checks)")
    return ok


def bench_shape(shape, args, device, dtype, kernels) -> list[dict]:
    """Every (formulation, kernel, mode) row for `args.batch` matrices of `shape`: each configuration warmed up
    once, then timed `args.repeats` times round-robin (so load drifting during the run hits them alike); the
    median, per matrix."""
    g = torch.Generator(device=device).manual_seed(0)
    mats = [torch.randn(*shape, generator=g, device=device) for _ in range(args.batch)]
    kw = dict(ns_steps=args.ns_steps, coefficients=args.coefficients, dtype=dtype)
    configs = {}
    for formulation in ("direct", "gram"):
        for kernel in kernels:
            opts = dict(kw, formulation=formulation, kernel=kernel)
            configs[(formulation, kernel, "one-by-one")] = lambda o=opts: [
                zeropower_via_newtonschulz(m, **o) for m in mats
            ]
            configs[(formulation, kernel, "batched")] = lambda o=opts: orthogonalize_stack(mats, **o)
    times: dict[tuple, list[float]] = {key: [] for key in configs}
    for rep in range(args.repeats + 1):
        for key, fn in configs.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if rep:  # the first round is the warm-up
                times[key].append(time.perf_counter() - t0)
    rows = []
    for (formulation, kernel, mode), ts in times.items():
        seconds = statistics.median(ts) / len(mats)
        rows.append(
            dict(
                shape=shape,
                formulation=formulation,
                kernel=kernel,
                mode=mode,
                ms=seconds * 1e3,
                tflops=ns_flops(shape, args.ns_steps) / seconds / 1e12,
            )
        )
    return rows


def ratio(rows: list[dict], key: str, slow: str, fast: str) -> float | None:
    """Total time of the `slow` rows over the `fast` rows, over the cells (shape and the other two keys) that
    have both."""
    others = [k for k in ("formulation", "kernel", "mode") if k != key]
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["shape"], *(r[k] for k in others)), {})[r[key]] = r["ms"]
    pairs = [(c[slow], c[fast]) for c in cells.values() if slow in c and fast in c]
    return sum(s for s, _ in pairs) / sum(f for _, f in pairs) if pairs else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(LLAMA3), choices=list(LLAMA3), help="Llama-3 sizes")
    p.add_argument("--batch", type=int, default=4, help="same-shape matrices per measurement (default 4)")
    p.add_argument("--scale", type=int, default=0, help="divide every shape by this (default: 1 on CUDA, 16 on CPU)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up round (median)")
    p.add_argument("--ns-steps", type=int, default=5)
    p.add_argument("--coefficients", default="polar_express", choices=("polar_express", "muon"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--check", action="store_true", help="first check the Triton kernels on --device (see above)")
    p.add_argument("--check-only", action="store_true", help="only the kernel check")
    p.add_argument("--dtype", default="", choices=("", "float32", "bfloat16"), help="NS dtype (default: device's)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.scale < 0:
        p.error("--batch and --repeats must be >= 1, --scale >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else default_ns_dtype(device)
    if args.check or args.check_only:
        ok = check_kernels(device)
        if args.check_only:
            sys.exit(0 if ok else 1)
    scale = args.scale or (1 if device.type == "cuda" else 16)
    why = triton_unusable(device, dtype) if device.type == "cuda" else "Triton needs a GPU"
    kernels = ["torch"] + ([] if why else ["triton"])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"bench_ns: {where}, NS in {str(dtype).removeprefix('torch.')}, {args.ns_steps} steps "
        f"({args.coefficients}), batches of {args.batch}, median of {args.repeats} rounds after a warm-up; "
        f"Llama-3 shapes{f' / {scale}' if scale > 1 else ''}; 1-min load {os.getloadavg()[0]:.2f}"
    )
    if why:
        print(f"Triton rows left out: {why}")
    header = f"{'model':<6}{'matrix':<10}{'shape':>13} {'formulation':<12}{'kernel':<8}{'mode':<11}"
    print(header + f"{'ms/matrix':>11}{'TFLOP/s':>9}")
    rows, t0 = [], time.perf_counter()
    for model in args.models:
        for name, (s, long) in LLAMA3[model].items():
            shape = (max(1, s // scale), max(1, long // scale))
            for r in bench_shape(shape, args, device, dtype, kernels):
                rows.append(r)
                print(
                    f"{model:<6}{name:<10}{f'{shape[0]}x{shape[1]}':>13} {r['formulation']:<12}{r['kernel']:<8}"
                    f"{r['mode']:<11}{r['ms']:11.2f}{r['tflops']:9.3f}",
                    flush=True,
                )
    parts = []
    for label, key, slow, fast in (
        ("speed-up of gram over direct", "formulation", "direct", "gram"),
        ("of batched over one-by-one", "mode", "one-by-one", "batched"),
        ("of triton over torch", "kernel", "torch", "triton"),
    ):
        r = ratio(rows, key, slow, fast)
        parts.append(f"{label} {r:.2f}x" if r is not None else f"{label} n/a ({why})")
    print(
        f"bench_ns {'+'.join(args.models)} {device.type} {str(dtype).removeprefix('torch.')}: "
        + ", ".join(parts)
        + f" ({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
