"""Import a script under scripts/ as a module, once per process.

Why once: scripts that use a process pool (prepare_data.py) pickle their worker functions by module name, so
every test must share the one module object registered in sys.modules under the script's name; loading the
file a second time would replace it and break the pickling of functions taken from the first copy.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py as module `name` (the one already loaded, if any); scripts/ goes on sys.path so that
    one script can import another by name."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == SCRIPTS / f"{name}.py":
        return module
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
