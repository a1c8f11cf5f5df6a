"""scripts/seed_exit.py (a DMuon script that ends with dist.destroy_process_group() and nothing else), reporting
after DMuon's own exit hook how many of the process groups DMuon made are still alive: 0 means their backends (and
gloo's worker threads) were freed while the interpreter was alive, not in its teardown.

    torchrun --standalone --nproc_per_node 2 tests/distributed/exit_check.py ddp|fsdp2
"""

import atexit
import runpy
import sys
import weakref
from pathlib import Path

made: list[weakref.ref] = []
# registered before the library is imported: atexit runs hooks last-in first-out, so this one runs after DMuon's


def _report() -> None:
    # one write of the whole line: the two ranks share torchrun's stdout, and a print's text and newline, written
    # apart, interleave there under load
    sys.stdout.write(f"DMuon groups alive after its exit hook: {sum(r() is not None for r in made)} of {len(made)}\n")
    sys.stdout.flush()


atexit.register(_report)

from titan_dmuon.dmuon import state  # noqa: E402

_dedicated_group = state.dedicated_group


def _tracked(*args, **kwargs):
    group = _dedicated_group(*args, **kwargs)
    if group is not None:
        made.append(weakref.ref(group))
    return group


state.dedicated_group = _tracked
sys.argv = ["seed_exit.py", sys.argv[1]]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "seed_exit.py"), run_name="__main__")
