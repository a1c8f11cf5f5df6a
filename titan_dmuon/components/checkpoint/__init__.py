"""Checkpoints: saving and resuming the run (DCP), their integrity, and the Hugging Face form of the weights.

One idea per module; each imports only the modules above it in this list:

    dcp_io.py    reading DCP checkpoints without unpickling code: read_metadata, SafeReader, SafeLoadPlanner
    integrity.py checksums.json: ChecksummingWriter (hashes what DCP writes), the manifest, the damage checks
    hf_io.py     Hugging Face weights: export_hf (safetensors, config.json, tokenizer), load_hf_weights (each rank
                 its share), the StateDictAdapter protocol a model family implements
    folder.py    the checkpoint folder on disk: step-<N> folders, temporaries, the small files beside DCP's
    rng.py       the generator states a checkpoint keeps per rank, as tensors
    memory.py    what a save or load costs in host memory: per-rank rows, one summary line for the job
    convert.py   conversions without a process group: DCP -> Hugging Face (streamed) or one torch file, HF -> DCP
    manager.py   CheckpointManager: what to save and when, the atomic commit, async saves, pruning, resuming

The names below are what the trainer, the scripts and the tests use; import a module for the rest.
"""

from .convert import ExportError, export_dcp_to_hf
from .dcp_io import SafeLoadPlanner, SafeReader, read_metadata
from .folder import complete_steps, step_folders
from .hf_io import export_hf, is_hf_folder, load_hf_weights
from .manager import CheckpointError, CheckpointManager, check_async_mode

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ExportError",
    "SafeLoadPlanner",
    "SafeReader",
    "check_async_mode",
    "complete_steps",
    "export_dcp_to_hf",
    "export_hf",
    "is_hf_folder",
    "load_hf_weights",
    "read_metadata",
    "step_folders",
]
