"""Newton-Schulz orthogonalization: one function for every caller, two formulations, named coefficient sets.

Why one function: every path (1D, HSDP, DDP, TP owner, TP distributed Gram) must run the same iteration, so
the optimizer calls only `zeropower_via_newtonschulz`; a single matrix or a same-shape batch, the formulation
("direct" or "gram") and the kernel of the symmetric products ("torch" or "triton", ns_ops.py) are
parameters, never a second implementation. `orthogonalize_stack` and `batch_plan` let an owner run its
same-shape matrices as one batched (bmm-shaped) call in memory-bounded chunks.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence

import torch

from .costs import ns_flops  # the cost model's, importable from here as before
from .ns_ops import NSOps, resolve_kernel

Coefficients = str | tuple[float, float, float] | Sequence[tuple[float, float, float]]

# Keller Jordan's quintic, the one torch.optim.Muon uses (repeated every step).
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al., 2025, degree 5): one optimal triple per step; the first ones carry a 1.01
# safety factor for low precision, the last one repeats for any further steps.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_COEFFICIENTS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]) + (
    _POLAR_EXPRESS_RAW[-1],
)

# Polar Express normalizes with a 1% cushion so that the spectral norm is safely below 1.
_NORM_CUSHION = {"polar_express": 1.01, "muon": 1.0}


def resolve_coefficients(spec: Coefficients, ns_steps: int) -> list[tuple[float, float, float]]:
    """Turn a name, one triple, or a list of triples into exactly `ns_steps` triples."""
    if ns_steps < 1 or ns_steps >= 100:
        raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
    if isinstance(spec, str):
        if spec == "muon":
            return [MUON_COEFFICIENTS] * ns_steps
        if spec == "polar_express":
            table = list(POLAR_EXPRESS_COEFFICIENTS)
            return table[:ns_steps] + [table[-1]] * max(0, ns_steps - len(table))
        raise ValueError(f"unknown ns_coefficients {spec!r}: use 'polar_express', 'muon', a triple or a list")
    triples = list(spec)
    if len(triples) == 3 and all(isinstance(x, (int, float)) for x in triples):
        return [tuple(float(x) for x in triples)] * ns_steps  # type: ignore[list-item]
    if not triples or not all(len(t) == 3 for t in triples):
        raise ValueError("ns_coefficients must be a triple (a, b, c) or a list of triples")
    triples = [tuple(float(x) for x in t) for t in triples]
    return triples[:ns_steps] + [triples[-1]] * max(0, ns_steps - len(triples))


def _norm_cushion(spec: Coefficients) -> float:
    return _NORM_CUSHION.get(spec, 1.0) if isinstance(spec, str) else 1.0


FORMULATIONS = ("direct", "gram")

GRAM_RESTART_GAIN = 40.0
"""The Gram formulation restarts (forms X and X·Xᵀ afresh) before a step that would take the product of the
`a` coefficients since the last restart above this: that product is the gain the iterate applies to the
smallest singular values, and to the rounding errors of the Gram matrix (spurious eigenvalues near zero grow
by about a² per step). Measured on ill-conditioned and low-rank-plus-noise inputs (docs/dmuon.md, "The
update"): 40 keeps bf16 Gram NS as close to the exact iteration as bf16 direct NS, and fp32 Gram NS within
1e-4 of fp32 direct, where no restart gives 1e3x norm blow-ups in bf16 and 1e-3 deviations in fp32."""

NS_MAX_BATCH_ELEMENTS = 1 << 26
"""Default bound on the elements of one batched NS call (`batch_plan`): a stack and its iterates in the NS
dtype stay within a few times this (64M elements: 128 MB per copy in bf16)."""


ENV_NATIVE_BF16 = "DMUON_CPU_NATIVE_BF16"
"""Overrides `cpu_has_native_bf16`'s answer: "1" (as on a CPU with native bf16 matmuls) or "0" (as on one without).
Machines of one kind differ in this CPU flag; the variable lets a run (or a test suite) take either path anywhere."""


def cpu_has_native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN on AVX512-BF16 / AMX), or what $DMUON_CPU_NATIVE_BF16
    says when it is set."""
    forced = os.environ.get(ENV_NATIVE_BF16, "").strip()
    if forced in ("1", "0"):
        return forced == "1"
    if forced:
        raise ValueError(f"{ENV_NATIVE_BF16}={forced!r}: use 1 (native bf16 matmuls), 0 (none) or leave it unset")
    return _detect_native_bf16()


@functools.cache
def _detect_native_bf16() -> bool:
    """The CPU's own answer, checked once."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the op
        return False


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """The NS dtype when none is given (the one place it is decided): bf16 on CUDA (tensor cores) and on a CPU
    with native bf16 matmuls (`cpu_has_native_bf16`), fp32 elsewhere (emulated bf16 is slower than fp32 there).
    Runs that must agree to fp32 rounding (layout parity) pin `ns_dtype=torch.float32`: bf16 would amplify the
    summation-order differences between layouts."""
    device = torch.device(device)
    if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def gram_restarts(triples: Sequence[tuple[float, float, float]]) -> tuple[int, ...]:
    """The steps before which the Gram formulation restarts (see GRAM_RESTART_GAIN). Polar Express, 5 steps:
    (2,); "muon", 5 steps: (2, 4)."""
    out, gain = [], 1.0
    for i, (a, _, _) in enumerate(triples):
        if i and gain * abs(a) > GRAM_RESTART_GAIN:
            out.append(i)
            gain = 1.0
        gain *= abs(a)
    return tuple(out)


def zeropower_via_newtonschulz(
    grad: torch.Tensor,
    *,
    ns_steps: int = 5,
    coefficients: Coefficients = "polar_express",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    formulation: str = "direct",
    kernel: str = "auto",
    full_shape: Sequence[int] | None = None,
    reduce_gram: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of a matrix (m, n), or of each matrix of a stack
    (batch, m, n), with `ns_steps` quintic iterations. Returns a tensor of `dtype` and of `grad`'s shape.

    Direct: X ← a·X + b·(X Xᵀ) X + c·(X Xᵀ)² X on the short side (X transposed when tall), after scaling X to
    Frobenius norm ≤ 1 (÷1.01 more for Polar Express). Gram: the same polynomial on the s×s Gram matrix
    (s the short side): Q = aI + bA + cA², A ← Q A Q, P ← Q P, and X ← P X at each restart
    (`gram_restarts`) and at the end; the s×s iterates are kept in fp32 (fp64 for fp64) while the products
    take their operands in `dtype` and accumulate in fp32. `kernel` picks who runs the symmetric products
    (ns_ops.py). A stack of one matrix runs the single-matrix path, so batching never changes a lone matrix.

    Distributed Gram (TP): `grad` is one block of a matrix of `full_shape` split along its long side;
    `reduce_gram` sums the blocks' partial Gram matrices over the TP group (one s×s fp32 all-reduce per
    restart segment), the norm comes from the first one's trace, and each rank returns its own block.
    """
    if grad.ndim not in (2, 3):
        raise ValueError(f"Newton-Schulz needs a 2D matrix or a (batch, m, n) stack, got shape {tuple(grad.shape)}")
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown NS formulation {formulation!r}: use 'direct' or 'gram'")
    if reduce_gram is not None and (formulation != "gram" or grad.ndim != 2):
        raise ValueError("a distributed (reduce_gram) Newton-Schulz needs formulation='gram' and one 2D block")
    triples = resolve_coefficients(coefficients, ns_steps)
    dtype = dtype or default_ns_dtype(grad.device)
    if grad.ndim == 3 and grad.shape[0] == 1:
        kw = dict(ns_steps=ns_steps, coefficients=coefficients, eps=eps, dtype=dtype, formulation=formulation)
        return zeropower_via_newtonschulz(grad[0], kernel=kernel, **kw).unsqueeze(0)
    ops = NSOps(resolve_kernel(kernel, grad.device, dtype), dtype)
    shape = tuple(full_shape) if full_shape is not None else tuple(grad.shape[-2:])
    x = grad.to(dtype)
    transposed = shape[0] > shape[1]
    if transposed:
        x = x.mT
    cushion = _norm_cushion(coefficients)
    if formulation == "direct":
        x = _direct(_normalize(x, cushion, eps), triples, ops)
    else:
        x = _gram(x, triples, ops, cushion, eps, reduce_gram)
    return x.mT if transposed else x


def _normalize(x: torch.Tensor, cushion: float, eps: float) -> torch.Tensor:
    """X / max(‖X‖_F·cushion, eps), per matrix of a stack."""
    if x.ndim == 2:
        return x / (x.norm() * cushion).clamp(min=eps)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return x / (norm * cushion).clamp(min=eps)


def _direct(x: torch.Tensor, triples: Sequence[tuple[float, float, float]], ops: NSOps) -> torch.Tensor:
    """The direct iteration; with the torch kernel on one matrix, op for op torch.optim.Muon's."""
    for a, b, c in triples:
        gram = ops.syrk(x, out_dtype=x.dtype)
        poly = ops.symm(gram, gram, alpha=c, beta=b, c=gram, out_dtype=x.dtype)
        x = torch.addmm(x, poly, x, beta=a) if x.ndim == 2 else torch.baddbmm(x, poly, x, beta=a)
    return x


def _gram(
    x: torch.Tensor,
    triples: Sequence[tuple[float, float, float]],
    ops: NSOps,
    cushion: float,
    eps: float,
    reduce_gram: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The Gram iteration in restart segments; s×s iterates in `state` precision, X ← P X per segment."""
    state = torch.float64 if x.dtype == torch.float64 else torch.float32
    if reduce_gram is None:
        x = _normalize(x, cushion, eps)
        gram = ops.syrk(x, out_dtype=state)
    else:  # distributed: the norm of the whole matrix is the root of the summed Gram's trace
        gram = reduce_gram(ops.syrk(x, out_dtype=state))
        scale = 1.0 / (gram.trace().sqrt() * cushion).clamp(min=eps)
        x = x * scale.to(x.dtype)
        gram = gram * (scale * scale)
    restarts = set(gram_restarts(triples))
    p = None
    for i, (a, b, c) in enumerate(triples):
        if i in restarts:
            x = _apply(p, x)
            gram = ops.syrk(x, out_dtype=state)
            gram = reduce_gram(gram) if reduce_gram is not None else gram
            p = None
        q = ops.symm(gram, gram, alpha=c, beta=b, c=gram, gamma=a, out_dtype=state)  # aI + bA + cA²
        p = q if p is None else ops.symm(q, p, out_dtype=state)
        if i + 1 < len(triples) and i + 1 not in restarts:  # the next step iterates on Q A Q, a congruence
            gram = ops.symm(ops.mm(q, gram, out_dtype=state), q, out_dtype=state)  # (Q·A unsymmetrized)
    return _apply(p, x)


def _apply(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """X ← P X, in X's dtype (a general product: torch's matmul on either kernel)."""
    return torch.matmul(p.to(x.dtype), x)


def batch_plan(
    shapes: Sequence[Sequence[int]],
    keys: Sequence[object] | None = None,
    max_elements: int = NS_MAX_BATCH_ELEMENTS,
) -> list[list[int]]:
    """Indices of matrices to orthogonalize together: the same `keys` entry (the NS settings) and the same
    shape up to transposition, in order of first appearance, split evenly into chunks of at most
    `max_elements` elements (one matrix at least)."""
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault((keys[i] if keys is not None else None, tuple(sorted(shape[-2:]))), []).append(i)
    plan = []
    for (_, (s, long)), idx in groups.items():
        per = max(1, max_elements // max(1, s * long))
        chunks = math.ceil(len(idx) / per)
        bounds = [round(k * len(idx) / chunks) for k in range(chunks + 1)]
        plan += [idx[lo:hi] for lo, hi in itertools.pairwise(bounds)]
    return plan


def orthogonalize_stack(
    mats: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None, **ns_kwargs
) -> list[torch.Tensor]:
    """NS of matrices of one shape up to transposition, in one batched call: tall ones are stacked transposed
    (NS transposes a tall matrix anyway) and handed back in their own orientation. `ns_kwargs` go to
    `zeropower_via_newtonschulz`."""
    if not mats:
        return []
    dtype = dtype or default_ns_dtype(mats[0].device)
    if len(mats) == 1:
        return [zeropower_via_newtonschulz(mats[0], dtype=dtype, **ns_kwargs)]
    s, long = sorted(mats[0].shape)
    if any(m.ndim != 2 or sorted(m.shape) != [s, long] for m in mats):
        raise ValueError(
            f"orthogonalize_stack needs matrices of one shape up to transposition, got {[tuple(m.shape) for m in mats]}"
        )
    tall = [m.shape[0] > m.shape[1] for m in mats]
    stack = torch.empty(len(mats), s, long, dtype=dtype, device=mats[0].device)
    for out, m, t in zip(stack, mats, tall, strict=True):
        out.copy_(m.mT if t else m)
    ortho = zeropower_via_newtonschulz(stack, dtype=dtype, **ns_kwargs)
    return [o.mT if t else o for o, t in zip(ortho.unbind(0), tall, strict=True)]


def get_ns_backend(
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    kernel: str = "auto",
    formulation: str = "direct",
) -> str:
    """What NS runs as for these settings, e.g. "Gram NS · kernel=triton (sm90, bfloat16)" or "Direct NS ·
    kernel=torch (cpu, float32)": the kernel "auto" resolves to here (DMUON_NS_KERNEL and the one-time check
    included) and the NS dtype (default: the device's). `device` defaults to the current CUDA device, else CPU."""
    if formulation not in FORMULATIONS:
        raise ValueError(f"unknown NS formulation {formulation!r}: use 'direct' or 'gram'")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    dtype = dtype or default_ns_dtype(device)
    resolved = resolve_kernel(kernel, device, dtype)
    where = "cpu" if device.type == "cpu" else device.type
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"sm{major}{minor}"
    return f"{formulation.capitalize()} NS · kernel={resolved} ({where}, {str(dtype).removeprefix('torch.')})"


__all__ = [
    "ENV_NATIVE_BF16",
    "FORMULATIONS",
    "GRAM_RESTART_GAIN",
    "MUON_COEFFICIENTS",
    "NS_MAX_BATCH_ELEMENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "batch_plan",
    "cpu_has_native_bf16",
    "default_ns_dtype",
    "get_ns_backend",
    "gram_restarts",
    "ns_flops",
    "orthogonalize_stack",
    "resolve_coefficients",
    "zeropower_via_newtonschulz",
]
