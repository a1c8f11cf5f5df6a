"""An independent reference Newton-Schulz, in any dtype (float64 for an exact one), to check NS implementations.

torch.optim.Muon's iteration (`torch.optim._muon._zeropower_via_newtonschulz`) written out in the dtype asked for
instead of bf16, with the "muon" and "polar_express" coefficient schedules (the Polar Express table as
published) and, optionally, the same polynomial run on the s×s Gram matrix. The tests compare
the library's NS (newton_schulz.py, its Triton kernels) against it.

It deliberately shares no code with the library's NS: this module imports nothing from titan_dmuon (a unit
test checks), so a bug in newton_schulz.py cannot hide in its own reference.
"""

from __future__ import annotations

import torch

# Keller Jordan's quintic, the one torch.optim.Muon uses (repeated every step).
MUON_ABC = (3.4445, -4.775, 2.0315)

# Polar Express (Amsel et al. 2025), degree-5 table as published; every triple but the last carries the 1.01
# safety factor, the last repeats for any further step, and the input is normalized with a 1.01 cushion.
_PE_RAW = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]
POLAR_EXPRESS = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _PE_RAW[:-1]] + [_PE_RAW[-1]]


def ns_schedule(ns_coefficients, ns_steps: int) -> tuple[list[tuple[float, float, float]], float]:
    """(one (a, b, c) per NS step, the normalization cushion) for "muon", "polar_express" or one triple."""
    if ns_coefficients == "muon":
        return [MUON_ABC] * ns_steps, 1.0
    if ns_coefficients == "polar_express":
        return POLAR_EXPRESS[:ns_steps] + [POLAR_EXPRESS[-1]] * max(0, ns_steps - len(POLAR_EXPRESS)), 1.01
    a, b, c = ns_coefficients
    return [(a, b, c)] * ns_steps, 1.0


def reference_ns(grad, ns_coefficients, ns_steps, eps, *, dtype=torch.float32, gram: bool = False):
    """torch.optim._muon._zeropower_via_newtonschulz written out in `dtype` (not bf16), with a coefficient
    schedule and cushion from `ns_schedule`. `gram=True` runs the same polynomial on the s×s Gram matrix
    (A <- Q A Q, P <- Q P with Q = aI + bA + cA², result P X)."""
    triples, cushion = ns_schedule(ns_coefficients, ns_steps)
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() * cushion).clamp(min=eps)
    if not gram:
        for a, b, c in triples:
            gram_matrix = x @ x.T
            gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    else:
        g = x @ x.T
        eye = torch.eye(g.size(0), dtype=dtype, device=x.device)
        p = eye
        for a, b, c in triples:
            q = a * eye + b * g + c * (g @ g)
            p = q @ p
            g = q @ g @ q
        x = p @ x
    return x.T if tall else x


__all__ = ["MUON_ABC", "POLAR_EXPRESS", "ns_schedule", "reference_ns"]
