"""`import dmuon`: the DMuon reference examples' spelling of `from titan_dmuon import dmuon`.

Not a copy: importing this module replaces itself in `sys.modules` with `titan_dmuon.dmuon`, so both spellings
give the same module object (one state, one FSDP2 patch). Submodules alias too: `import dmuon.muon` is
`titan_dmuon.dmuon.muon`, never a second copy of its classes.
"""

import importlib
import importlib.abc
import importlib.util
import sys

from titan_dmuon import dmuon as _dmuon


class _SubmoduleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `dmuon.X` to the already-imported (or now imported) `titan_dmuon.dmuon.X`."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(_dmuon.__name__ + spec.name[len(__name__) :])

    def exec_module(self, module):
        pass  # already executed under its titan_dmuon.dmuon name


if not any(type(f).__name__ == _SubmoduleAlias.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _SubmoduleAlias())
sys.modules[__name__] = _dmuon
