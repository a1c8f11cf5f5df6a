"""The README's commands name flags that exist: every `--section.field` given to train.py (or passed through a script
to train.py's config) is a config field, and every other flag of `python scripts/X.py` is one that script's
parser takes. A renamed flag fails here instead of in a newcomer's terminal."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from tests._scripts import load_script
from titan_dmuon.config import JobConfig

REPO = Path(__file__).resolve().parents[3]


def _commands() -> list[list[str]]:
    """The README's shell commands (bash blocks, continuation lines joined, env assignments dropped)."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0])
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words:
                out.append(words)
    return out


def _config_fields(obj: object, prefix: str = "") -> set[str]:
    names = set()
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            names |= _config_fields(value, f"{prefix}{f.name}.")
        else:
            names.add(f"{prefix}{f.name}")
    return names


class _Parsed(Exception):
    pass


def _script_flags(name: str, monkeypatch) -> set[str]:
    """The option strings of scripts/<name>.py's parser: its `main` runs until it parses its arguments."""
    parsers = []

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Parsed):
            load_script(name).main([])
    return {s for action in parsers[0]._actions for s in action.option_strings}


def test_readme_flags_exist(monkeypatch) -> None:
    config, checked = _config_fields(JobConfig()), 0
    for words in _commands():
        script = next((w for w in words if w.endswith(".py") or w.endswith(".sh") or w.endswith(".slurm")), None)
        if script is None or script.endswith(("quickstart.py", "download_hf_assets.py")):
            continue
        own = (
            _script_flags(Path(script).stem, monkeypatch)
            if script.startswith("scripts/") and script.endswith(".py")
            else set()
        )
        for word in words[words.index(script) + 1 :]:  # the launcher's own flags come before the script
            if not word.startswith("--"):
                continue
            flag = word.split("=")[0]
            if flag in own or flag == "--config":
                continue
            assert "." in flag and flag[2:] in config, f"README: {' '.join(words)}: {flag} is not a flag of {script}"
            checked += 1
    assert checked >= 10  # the README's commands were found and read


def test_ci_runs_the_readmes_test_command() -> None:
    """The README opens with two commands, train then test; `.ci/run` runs the test one verbatim (its install of the
    test extra included), and the train command installs the project without extras: what training needs."""
    text = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S)[1].strip().splitlines()
    assert len(first_block) == 2, first_block
    train, test = first_block
    assert "train.py --config" in train and "pip install -c requirements/constraints.txt -e . &&" in train, train
    assert '-e ".[test]"' in test and test.endswith("python3 -m pytest -q tests"), test
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test, ci[-1]
