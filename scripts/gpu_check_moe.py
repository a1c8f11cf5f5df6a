"""A bf16 MoE experts step (forward and backward) with an expert that gets no token, against an fp32 per-expert loop
(scripts/gpu_check.sh's moe section). It says which path ran: `GroupedExperts.forward` takes `torch._grouped_mm`
on CUDA (bf16, compute capability >= 9.0) and the per-expert loop elsewhere; on a CPU it also runs
`experts_grouped_mm` itself, since the CPU build has `torch._grouped_mm` too. Checked: the output and the grads of
the input and of every expert within bf16 tolerance of the fp32 reference, everything finite, and the grads of the
experts without rows exactly zero.

    python scripts/gpu_check_moe.py                 # cuda if there is one, else cpu
    python scripts/gpu_check_moe.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from titan_dmuon.models.common import moe  # noqa: E402

# Norm-wise relative error allowed against the fp32 reference: bf16 carries 8 bits (2^-8 = 3.9e-3 per rounding);
# three chained matmuls of this size and their backward stay within ~1e-2 (measured 4e-3 to 8e-3 on CPU).
RTOL = 2e-2


class _Counted:
    """`torch._grouped_mm` with a call count (which path ran)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def case(device: torch.device, counts: list[int], dim: int = 64, hidden: int = 128, seed: int = 0):
    """(x, counts, [w1, w2, w3], r): bf16 leaves on `device`, rows sorted by expert; r the output's cotangent."""
    g = torch.Generator().manual_seed(seed)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, dim, generator=g)
    ws = [torch.randn(e, hidden, dim, generator=g) / dim**0.5, torch.randn(e, dim, hidden, generator=g) / hidden**0.5]
    ws.append(torch.randn(e, hidden, dim, generator=g) / dim**0.5)
    r = torch.randn(n, dim, generator=g)
    return x, torch.tensor(counts), ws, r


def run(fn, device, x, counts, ws, r, dtype):
    """fn's output and the grads of x, w1, w2, w3 through <fn(x), r>."""
    leaves = [t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_() for t in (x, *ws)]
    out = fn(leaves[0], counts.to(device), *leaves[1:])
    (out.float() * r.to(device)).sum().backward()
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves]


def compare(name: str, got, want, counts: list[int]) -> bool:
    labels = ("out", "grad x", "grad w1", "grad w2", "grad w3")
    errs = {k: rel_err(a, b) for k, a, b in zip(labels, got, want, strict=True)}
    finite = all(bool(torch.isfinite(t).all()) for t in got)
    empty = [e for e, c in enumerate(counts) if c == 0]
    zero = all(bool((g[e] == 0).all()) for g in got[2:] for e in empty)
    ok = finite and zero and max(errs.values()) <= RTOL
    figures = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    print(
        f"{'PASS' if ok else 'FAIL'} {name}: rel err vs fp32 loop {figures} (rtol {RTOL:g}); finite {finite}; "
        f"grads of the empty expert(s) {empty} exactly zero: {zero}"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    counts = [40, 0, 24, 56, 8, 0, 32, 16]  # experts 1 and 5 get no token
    x, c, ws, r = case(device, counts)
    want = run(moe.experts_loop, "cpu", x, c, ws, r, torch.float32)
    ok = True

    if not hasattr(torch, "_grouped_mm"):
        print(f"torch {torch.__version__} has no torch._grouped_mm: the experts run one by one everywhere")
    counter = _Counted(torch._grouped_mm) if hasattr(torch, "_grouped_mm") else None
    experts = moe.GroupedExperts(x.shape[1], ws[0].shape[1], len(counts))

    def model_path(xx, cc, w1, w2, w3):  # GroupedExperts.forward on these weights: the model's path on this device
        return _forward_with(experts, xx, cc, (w1, w2, w3))

    if counter is not None:
        torch._grouped_mm = counter
    try:
        got = run(model_path, device, x, c, ws, r, torch.bfloat16)
    finally:
        if counter is not None:
            torch._grouped_mm = counter.fn
    path = "torch._grouped_mm" if counter is not None and counter.calls else "the per-expert loop (experts_loop)"
    print(f"{device} bf16: GroupedExperts.forward ran {path}" + (f" ({counter.calls} calls)" if counter else ""))
    ok &= compare(f"GroupedExperts bf16 on {device} via {path}", got, want, counts)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap >= (9, 0) and not (counter and counter.calls):
            print(f"FAIL: compute capability {cap} should run torch._grouped_mm, but the loop ran")
            ok = False
        elif cap < (9, 0):
            print(f"note: compute capability {cap} < (9, 0): the model runs the loop here, as it should")
    elif counter is not None:
        got = run(moe.experts_grouped_mm, device, x, c, ws, r, torch.bfloat16)
        ok &= compare(f"experts_grouped_mm bf16 on {device} (torch._grouped_mm of the CPU build)", got, want, counts)
        print("note: on CPU the model itself runs the loop; the CUDA grouped_mm kernels need a GPU")

    if os.environ.get("GPU_CHECK_PLANTED"):
        print("FAIL: planted failure (GPU_CHECK_PLANTED)")
        ok = False
    print(f"moe: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _forward_with(experts: moe.GroupedExperts, x, counts, weights):
    """`experts.forward(x, counts)` whose weights are `weights` (leaves that collect the grads)."""
    saved = experts.w1, experts.w2, experts.w3
    try:
        del experts.w1, experts.w2, experts.w3
        experts.w1, experts.w2, experts.w3 = weights
        return experts(x, counts)
    finally:
        del experts.w1, experts.w2, experts.w3
        experts.w1, experts.w2, experts.w3 = saved


if __name__ == "__main__":
    sys.exit(main())
