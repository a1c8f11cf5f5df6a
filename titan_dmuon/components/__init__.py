"""The trainer's parts, one idea a module: the model registry (`model.py`, `model.name`), the optimizer components
(`optimizer/`, `optimizer.name`), checkpointing, data loaders, the lr schedule, metrics, profiling, validation and
generation. Import the submodule you need; this package imports nothing on its own."""
