"""`import dmuon` (the repo-root dmuon.py, installed as a top-level module) is `titan_dmuon.dmuon`: one module
object, one FSDP2 patch, and its submodules are the same objects too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_import_dmuon_is_titan_dmuon_dmuon() -> None:
    import dmuon
    import titan_dmuon.dmuon as d

    assert dmuon is d
    assert dmuon.Muon is d.Muon and dmuon.fsdp_units is d.fsdp_units


def test_alias_first_gives_one_module_and_one_patch() -> None:
    """In a fresh interpreter: `import dmuon` first, `titan_dmuon.dmuon` second; submodules through the alias
    are the package's own (no second copy of a class), and FSDP2's function is wrapped once."""
    code = textwrap.dedent(
        """
        import inspect
        import sys

        import dmuon
        import dmuon.muon
        from dmuon.param import DedicatedParam
        import titan_dmuon.dmuon as d
        import titan_dmuon.dmuon.muon
        from torch.distributed.fsdp._fully_shard import _fsdp_init

        assert dmuon is d is sys.modules["dmuon"] is sys.modules["titan_dmuon.dmuon"]
        assert dmuon.muon is titan_dmuon.dmuon.muon and DedicatedParam is d.DedicatedParam
        aliases = {k: m for k, m in sys.modules.items() if k.startswith("dmuon.")}
        assert all(m is sys.modules["titan_dmuon." + k] for k, m in aliases.items()), aliases
        patched = _fsdp_init._get_managed_states
        assert getattr(patched, "_dmuon_patched", False)
        original = inspect.getclosurevars(patched).nonlocals["original"]
        assert not getattr(original, "_dmuon_patched", False), "the FSDP2 patch is applied twice"
        d.install_patch()  # idempotent
        assert _fsdp_init._get_managed_states is patched
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
