"""The one exception the data pipeline raises for bad input: the trainer reports it as a config error."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset or tokenizer that cannot be used as given; the message names the file (and line) and the fix."""
