"""train.py's logging set-up (titan_dmuon/trainer.py `set_up_logging`): rank 0 at INFO, the others at WARNING, and
TITAN_DMUON_LOG_LEVEL for titan_dmuon's own records (the DEBUG ones are machine-readable, e.g. the checkpoint memory
JSON that tests/integration/test_checkpoint.py reads)."""

from __future__ import annotations

import logging

import pytest

from titan_dmuon.trainer import LOG_LEVEL_ENV, set_up_logging


@pytest.fixture
def logs(capsys):
    """What the configured logging prints (to the captured stderr); the global logging state comes back after."""
    root, ours = logging.getLogger(), logging.getLogger("titan_dmuon")
    saved = root.handlers[:], root.level, ours.level
    yield lambda: capsys.readouterr().err
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.setLevel(saved[2])


def _emit() -> None:
    for name in ("titan_dmuon.components.checkpoint", "other_library"):
        log = logging.getLogger(name)
        log.debug("%s debug", name)
        log.info("%s info", name)
        log.warning("%s warning", name)


@pytest.mark.parametrize(
    ("rank", "level", "want"),
    [
        (0, None, {"titan_dmuon.components.checkpoint info", "other_library info"}),
        (1, None, set()),
        (0, "debug", {"titan_dmuon.components.checkpoint debug", "titan_dmuon.components.checkpoint info"}),
        (1, "DEBUG", set()),
        (0, "WARNING", set()),
    ],
)
def test_levels(logs, monkeypatch, rank, level, want):
    """DEBUG adds titan_dmuon's debug records on rank 0 only, never another library's; warnings always show."""
    if level is None:
        monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(LOG_LEVEL_ENV, level)
    set_up_logging(rank)
    _emit()
    lines = {line.split(": ", 1)[1] for line in logs().splitlines()}
    warnings = {"titan_dmuon.components.checkpoint warning", "other_library warning"}
    if level == "debug":
        want |= {"other_library info"}
    assert lines == want | warnings


def test_a_bad_level_is_said_and_info_used(logs, monkeypatch):
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    set_up_logging(0)
    logging.getLogger("titan_dmuon.x").info("still info")
    text = logs()
    assert f"{LOG_LEVEL_ENV}=LOUD is not a logging level" in text and "still info" in text
