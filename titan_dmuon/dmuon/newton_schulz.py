"""Newton-Schulz orthogonalization: one function, two formulations, named coefficient sets.

Why one function: every path (1D, HSDP, DDP, TP) must run bitwise the same iteration, so the optimizer calls
only `zeropower_via_newtonschulz` and the formulation/backend is a parameter, never a second implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

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


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exactness, no bf16 matmul speedup there), bf16 on CUDA (tensor cores)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def zeropower_via_newtonschulz(
    grad: torch.Tensor,
    *,
    ns_steps: int = 5,
    coefficients: Coefficients = "polar_express",
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    formulation: str = "direct",
    full_shape: Sequence[int] | None = None,
    reduce_gram: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Approximate the orthogonal polar factor U Vᵀ of a 2D matrix with `ns_steps` quintic iterations.

    X ← a·X + b·(X Xᵀ) X + c·(X Xᵀ)² X, on the short side (X is transposed when tall), after scaling X
    to Frobenius norm ≤ 1. `formulation="gram"` iterates on the s×s Gram matrix instead (s the short side):
    A ← Q A Q and P ← Q P with Q = aI + bA + cA², then returns P X₀: the same polynomial, s³ per step
    instead of s²·l, which wins for very rectangular matrices. Returns a tensor of `dtype`.

    Distributed Gram (TP): `grad` is one block of a matrix of `full_shape` split along its long side;
    `reduce_gram` sums the blocks' partial Gram matrices over the TP group (one s×s all-reduce), the
    norm comes from its trace, and each rank returns its own block of the result.
    """
    if grad.ndim != 2:
        raise ValueError(f"Newton-Schulz needs a 2D matrix, got shape {tuple(grad.shape)}")
    triples = resolve_coefficients(coefficients, ns_steps)
    dtype = dtype or default_ns_dtype(grad.device)
    shape = tuple(full_shape) if full_shape is not None else tuple(grad.shape)
    x = grad.to(dtype)
    transposed = shape[0] > shape[1]
    if transposed:
        x = x.T
    cushion = _norm_cushion(coefficients)
    if reduce_gram is not None:
        if formulation != "gram":
            raise ValueError("a distributed (reduce_gram) Newton-Schulz needs formulation='gram'")
        gram = reduce_gram(x @ x.T)
        scale = 1.0 / (gram.trace().sqrt() * cushion).clamp(min=eps)
        x = x * scale
        gram = gram * (scale * scale)
    else:
        x = x / (x.norm() * cushion).clamp(min=eps)
        gram = x @ x.T
    if formulation == "direct":
        for i, (a, b, c) in enumerate(triples):
            if i:
                gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    elif formulation == "gram":
        eye = torch.eye(gram.size(0), dtype=dtype, device=gram.device)
        acc = None
        for a, b, c in triples:
            q = torch.addmm(gram, gram, gram, beta=b, alpha=c).add_(eye, alpha=a)
            acc = q if acc is None else q @ acc
            gram = q @ gram @ q
        x = acc @ x
    else:
        raise ValueError(f"unknown NS formulation {formulation!r}: use 'direct' or 'gram'")
    return x.T if transposed else x


def ns_flops(shape: Sequence[int], ns_steps: int) -> float:
    """Matmul FLOPs of the direct formulation on an (m, n) matrix (s = short side, long = long side)."""
    s, long = sorted(shape[:2])
    return 2.0 * ns_steps * (2 * s * s * long + s * s * s)


def get_ns_backend() -> str:
    """Say which NS path runs here (handy in bug reports and when bringing up a new cluster)."""
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"Direct NS · kernel=torch.matmul (cuBLAS, SM{cap[0]}{cap[1]}, bf16)"
    return f"Direct NS · kernel=torch.matmul (CPU, fp32, {torch.get_num_threads()} threads)"


__all__ = [
    "MUON_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "default_ns_dtype",
    "get_ns_backend",
    "ns_flops",
    "resolve_coefficients",
    "zeropower_via_newtonschulz",
]
