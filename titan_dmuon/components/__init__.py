"""Pluggable parts chosen by name from the config: model families (`model.py`, `model.name`) and optimizers
(`optimizer/`, `optimizer.name`). Import the submodule you need; this package imports nothing on its own."""
