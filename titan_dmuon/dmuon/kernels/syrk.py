"""Newton-Schulz's products in Triton: OUT = α·A·Bᵀ + β·C + γ·I, symmetric ones on lower-triangle tiles only.

Why: every short-side product of NS is symmetric (X Xᵀ, A², and in the Gram formulation Q·P and (Q·A)·Q of
symmetric matrices that commute), so half the tiles are mirrors of the other half. Each program of the
symmetric kernel computes one lower tile (i ≥ j) in an fp32 accumulator and stores it and its transpose; a
diagonal tile is symmetrized from its lower half, so OUT is exactly symmetric. `symmetric=False` computes
every tile (the Gram formulation's Q·A, which must not be symmetrized: Q·A·Q is then a congruence of A and
keeps it positive semidefinite). A, B are (batch, n, k) or (n, k), any strides; shapes need not be
multiples of the tile.

Operand precision (`precision`): "bf16" / "fp16" (tensor cores), "tf32" (fp32 operands rounded to TF32, to
nearest even, on tensor cores) or "ieee" (fp32); the accumulator is fp32 in every case.

Under TRITON_INTERPRET=1 (read when this module is imported, i.e. when `@triton.jit` runs) the kernel runs
on CPU tensors. It calls no `@triton.jit` helper of triton.language (tl.zeros, tl.cdiv, ...): those are built
when Triton itself is imported, so this module re-imported under the interpreter after Triton was imported
without it would still call compiled-mode ones. The interpreter's `tl.dot` is wrong on bf16 and its fp32 ->
bf16 cast truncates, so there the operands are rounded to the precision's grid by their bits (nearest even,
as a GPU rounds) and multiplied in fp32, and a bf16 result is rounded the same way before it is stored: the
GPU's numbers, on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""Whether the kernel below was built for the interpreter (TRITON_INTERPRET=1 when this module loaded)."""

PRECISIONS = ("bf16", "fp16", "tf32", "ieee")
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _lower_tile(pid):
    """The (i, j) lower-triangle tile (i >= j) of linear index pid = i(i+1)/2 + j."""
    i = ((tl.sqrt((8 * pid + 1).to(tl.float32)) - 1) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)  # fix the fp32 rounding of the square root
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _round_bits(x, DROP: tl.constexpr):
    """fp32 `x` rounded to nearest even with its lowest DROP mantissa bits cleared (16: bf16, 13: tf32)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _operand(x, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """A dot operand at PRECISION: for the GPU's tensor cores, or (UPCAST, the interpreter) in fp32 on the
    same grid."""
    if PRECISION == "tf32":
        y = _round_bits(x.to(tl.float32), 13)
    elif PRECISION == "ieee":
        y = x.to(tl.float32)
    elif UPCAST:
        if PRECISION == "bf16":
            y = _round_bits(x.to(tl.float32), 16)
        else:
            y = x.to(tl.float32).to(tl.float16).to(tl.float32)
    elif PRECISION == "bf16":
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def _products_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    n,
    k,
    s_ab,
    s_an,
    s_ak,
    s_bb,
    s_bn,
    s_bk,
    s_cb,
    s_cn,
    s_cm,
    s_ob,
    s_on,
    s_om,
    alpha,
    beta,
    gamma,
    tiles,
    SYMMETRIC: tl.constexpr,
    HAS_C: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one 1D grid over (matrix, tile): no per-dimension grid limit on the batch
    pid = tl.program_id(0)
    batch = (pid // tiles).to(tl.int64)
    tile = pid % tiles
    if SYMMETRIC:
        ti, tj = _lower_tile(tile)
    else:
        per_row = (n + BLOCK - 1) // BLOCK
        ti, tj = tile // per_row, tile % per_row
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + batch * s_ab + rows[:, None] * s_an
    b_base = b_ptr + batch * s_bb + cols[:, None] * s_bn
    acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_base + kk[None, :] * s_ak, mask=(rows[:, None] < n) & (kk[None, :] < k), other=0.0)
        b = tl.load(b_base + kk[None, :] * s_bk, mask=(cols[:, None] < n) & (kk[None, :] < k), other=0.0)
        a = _operand(a, PRECISION, UPCAST)
        b = _operand(b, PRECISION, UPCAST)
        if UPCAST or PRECISION == "ieee":
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        elif PRECISION == "tf32":
            acc = tl.dot(a, tl.trans(b), acc, input_precision="tf32")
        else:  # bf16/fp16 tensor cores, fp32 accumulate
            acc = tl.dot(a, tl.trans(b), acc)
    acc = acc * alpha
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    if HAS_C:
        c = tl.load(c_ptr + batch * s_cb + rows[:, None] * s_cn + cols[None, :] * s_cm, mask=inside, other=0.0)
        acc += beta * c.to(tl.float32)
    if ti == tj:
        acc += tl.where(rows[:, None] == cols[None, :], gamma, 0.0)
        if SYMMETRIC:  # mirror the diagonal tile's lower half: OUT is exactly symmetric
            acc = tl.where(rows[:, None] < cols[None, :], tl.trans(acc), acc)
    if ROUND_OUT:  # a bf16 result in the interpreter, whose cast would truncate
        acc = _round_bits(acc, 16)
    out = acc.to(out_ptr.dtype.element_ty)
    o_base = out_ptr + batch * s_ob
    tl.store(o_base + rows[:, None] * s_on + cols[None, :] * s_om, out, mask=inside)
    if SYMMETRIC:
        if ti != tj:
            tl.store(o_base + cols[:, None] * s_on + rows[None, :] * s_om, tl.trans(out), mask=tl.trans(inside))


def _blocks(precision: str) -> tuple[int, int, int, int]:
    """(BLOCK, BLOCK_K, num_warps, num_stages): few large tiles for the interpreter (its cost is per tile and
    per k-step), tensor-core tiles on a GPU."""
    if INTERPRETED:
        return 64, 64, 4, 1
    if precision == "ieee":
        return 64, 32, 4, 3
    if precision == "tf32":
        return 128, 32, 8, 3
    return 128, 64, 8, 3


def sym_matmul(
    a: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    gamma: float = 0.0,
    out_dtype: torch.dtype | None = None,
    precision: str | None = None,
    symmetric: bool = True,
) -> torch.Tensor:
    """α·A·Bᵀ + β·C + γ·I for (batch, n, k) or (n, k) A and B (B = A by default).

    `symmetric=True` computes the lower triangle and mirrors it: the caller promises the result is symmetric
    (B = A, or A·Bᵀ symmetric, e.g. B symmetric and commuting with A, where A·Bᵀ = A·B); C is then read on its
    lower triangle only. `precision` is the operands' (see the module doc; default: "bf16", "fp16" or "ieee"
    after A's dtype); `out_dtype` the result's (default: A's dtype).
    """
    b = a if b is None else b
    squeeze = a.ndim == 2
    if squeeze:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
        c = c.unsqueeze(0) if c is not None else None
    if a.ndim != 3 or a.shape != b.shape:
        raise ValueError(f"sym_matmul needs A and B of one (batch, n, k) shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype not in _INPUT_DTYPES or b.dtype not in _INPUT_DTYPES:
        raise ValueError(f"sym_matmul takes bfloat16, float16 or float32 operands, got {a.dtype}, {b.dtype}")
    if a.device != b.device or (c is not None and c.device != a.device):
        raise ValueError("sym_matmul: A, B and C must be on one device")
    precision = precision or {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(a.dtype, "ieee")
    if precision not in PRECISIONS:
        raise ValueError(f"sym_matmul: precision must be one of {PRECISIONS}, got {precision!r}")
    batch, n, k = a.shape
    out = torch.empty(batch, n, n, device=a.device, dtype=out_dtype or a.dtype)
    if c is not None and c.shape != out.shape:
        raise ValueError(f"sym_matmul: C has shape {tuple(c.shape)}, expected {tuple(out.shape)}")
    if batch == 0 or n == 0:
        return out.squeeze(0) if squeeze else out
    block, block_k, warps, stages = _blocks(precision)
    per_row = triton.cdiv(n, block)
    tiles = per_row * (per_row + 1) // 2 if symmetric else per_row * per_row
    cc = c if c is not None else out  # never read without HAS_C
    _products_kernel[(batch * tiles,)](
        a,
        b,
        cc,
        out,
        n,
        k,
        *a.stride(),
        *b.stride(),
        *cc.stride(),
        *out.stride(),
        float(alpha),
        float(beta),
        float(gamma),
        tiles,
        SYMMETRIC=symmetric,
        HAS_C=c is not None,
        PRECISION=precision,
        UPCAST=INTERPRETED,
        ROUND_OUT=INTERPRETED and out.dtype == torch.bfloat16,
        BLOCK=block,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out.squeeze(0) if squeeze else out


__all__ = ["INTERPRETED", "PRECISIONS", "sym_matmul"]
