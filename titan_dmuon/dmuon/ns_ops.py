"""The products Newton-Schulz runs, on one kernel, and how `kernel="auto"` picks that kernel.

NS needs two symmetric products besides plain matmuls: `syrk(X) = X·Xᵀ` and `symm(A, B) = α·A·B + β·C + γ·I`
for commuting symmetric A and B (every short-side product of the iteration is one). The "torch" kernel runs
them with torch.matmul/addmm, exactly the ops torch.optim.Muon runs; the "triton" kernel computes only the
lower-triangle tiles (kernels/syrk.py). Resolution of `kernel`:

- "torch", "triton": that one ("triton" raises when it cannot run here: no Triton, no CUDA tensor and no
  TRITON_INTERPRET=1, or a dtype it does not take);
- "auto" (default): the `DMUON_NS_KERNEL` environment variable when set (one of the three), else Triton on
  CUDA when it imports and passes a one-time numerical check against torch on this device and dtype, else
  torch. CPU tensors always get torch under "auto" (the Triton interpreter is for tests, not for speed).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import kernels

KERNELS = ("auto", "triton", "torch")
ENV_KERNEL = "DMUON_NS_KERNEL"
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

logger = logging.getLogger(__name__)


def resolve_kernel(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "torch" or "triton": what `kernel` means for NS products in `dtype` on `device` (see the module doc)."""
    if kernel not in KERNELS:
        raise ValueError(f"NS kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "auto":
        env = os.environ.get(ENV_KERNEL, "").strip().lower()
        if env and env not in KERNELS:
            raise ValueError(f"{ENV_KERNEL}={env!r}: use one of {KERNELS}")
        kernel = env or "auto"
    if kernel == "triton":
        why = triton_unusable(device, dtype)
        if why:
            raise RuntimeError(f"NS kernel 'triton' cannot run here: {why}")
        return "triton"
    if kernel == "torch" or device.type != "cuda" or triton_unusable(device, dtype):
        return "torch"
    return "triton" if _triton_passes_check(device, dtype) else "torch"


def triton_unusable(device: torch.device, dtype: torch.dtype) -> str:
    """Why the Triton kernels cannot run on `device` in `dtype` ("" when they can)."""
    module, why = kernels.load()
    if module is None:
        return why
    if dtype not in TRITON_DTYPES:
        return f"the kernels take bfloat16, float16 or float32, not {dtype}"
    if device.type == "cuda" or (device.type == "cpu" and module.INTERPRETED):
        return ""
    return (
        f"Triton needs CUDA tensors, got {device.type} (on CPU only under TRITON_INTERPRET=1, set before "
        "titan_dmuon.dmuon.kernels.syrk is imported)"
    )


@functools.cache
def _triton_passes_check(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per (device, dtype): the Triton products NS runs (X·Xᵀ, Q = aI + bA + cA², Q·A) against float64
    torch on a small ragged batch; a compile or launch error counts as a failure."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 150, 200, device=device, generator=gen).to(dtype)
    try:
        ops = NSOps("triton", dtype)
        a = ops.syrk(x, out_dtype=torch.float32)  # the products the Gram formulation runs, at its precisions
        want_a = x.double() @ x.double().mT
        q = ops.symm(a, a, alpha=0.5, beta=-1.0, c=a, gamma=2.0, out_dtype=torch.float32)
        want_q = 0.5 * (want_a @ want_a) - want_a + 2.0 * torch.eye(150, device=device, dtype=torch.float64)
        qa = ops.mm(q, a, out_dtype=torch.float32)
        errs = [_rel(a, want_a), _rel(q, want_q), _rel(qa, want_q @ want_a)]
    except Exception as e:  # a Triton/driver mismatch surfaces here, at compile or launch
        logger.warning("dmuon NS: the Triton kernels failed on %s (%s): %s; using torch", device, dtype, e)
        return False
    if max(errs) > tol:
        logger.warning(
            "dmuon NS: Triton differs from torch on %s (%s) by %s > %g; using torch", device, dtype, errs, tol
        )
        return False
    return True


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


class NSOps:
    """The products of NS on one kernel, for NS dtype `dtype`. Operands are multiplied at their own dtype's
    precision (bf16, fp16, fp32; fp64 on torch only) with an fp32 accumulator, except that on Triton the fp32
    operands of a 16-bit NS (the Gram formulation's s×s iterates) go through TF32 tensor cores, rounded to
    nearest: 8x finer than bf16, which the Gram iteration needs (docs/dmuon.md, "The update"). Results are
    stored in the `out_dtype` the caller asks for."""

    def __init__(self, kernel: str, dtype: torch.dtype):
        if kernel not in ("torch", "triton"):
            raise ValueError(f"NSOps takes a resolved kernel ('torch' or 'triton'), got {kernel!r}")
        self.kernel = kernel
        self.dtype = dtype
        self._triton = kernels.load()[0] if kernel == "triton" else None
        self._fp32 = "tf32" if dtype in (torch.bfloat16, torch.float16) else "ieee"

    def _precision(self, x: torch.Tensor) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x.dtype, self._fp32)

    def syrk(self, x: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
        """X·Xᵀ of a (…, s, l) matrix or stack."""
        if self._triton is not None:
            return self._triton.sym_matmul(x, out_dtype=out_dtype, precision=self._precision(x))
        return (x @ x.mT).to(out_dtype)

    def symm(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        alpha: float = 1.0,
        beta: float = 0.0,
        c: torch.Tensor | None = None,
        gamma: float = 0.0,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """α·A·B + β·C + γ·I, symmetric: B symmetric and A·B symmetric (A = B, A and B commuting, or A = Q·M and
        B = Q with M symmetric)."""
        if self._triton is not None:
            return self._triton.sym_matmul(
                a, b, alpha=alpha, beta=beta, c=c, gamma=gamma, out_dtype=out_dtype, precision=self._precision(a)
            )
        if c is not None and c.dtype == a.dtype == out_dtype and gamma == 0.0:  # torch.optim.Muon's own op
            if a.ndim == 2:
                return torch.addmm(c, a, b, beta=beta, alpha=alpha)
            return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
        out = (a @ b).to(out_dtype)
        if alpha != 1.0:
            out = out * alpha
        if c is not None:
            out = out.add_(c.to(out_dtype), alpha=beta)
        if gamma:
            out.diagonal(dim1=-2, dim2=-1).add_(gamma)
        return out

    def mm(self, a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
        """A·B for a symmetric B, every entry computed (the result need not be symmetric)."""
        if self._triton is not None:
            return self._triton.sym_matmul(a, b, out_dtype=out_dtype, precision=self._precision(a), symmetric=False)
        return (a @ b).to(out_dtype)


__all__ = ["ENV_KERNEL", "KERNELS", "NSOps", "TRITON_DTYPES", "resolve_kernel", "triton_unusable"]
