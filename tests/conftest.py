"""Fixtures every test tier can use."""

from __future__ import annotations

import pytest

from titan_dmuon.dmuon.newton_schulz import ENV_NATIVE_BF16


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-native-bf16"])
def native_bf16(request, monkeypatch) -> bool:
    """Runs the test twice: as on a CPU with native bf16 matmuls and as on one without (machines of one kind differ;
    the NS dtype's default follows it), whatever this CPU has. Yields the answer `cpu_has_native_bf16` now gives."""
    monkeypatch.setenv(ENV_NATIVE_BF16, "1" if request.param else "0")
    return request.param
