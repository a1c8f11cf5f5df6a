"""Checkpoints: sharded torch.distributed.checkpoint (DCP) saves, atomic on disk, resumable on any topology.

    ckpt = CheckpointManager(cfg, optim, lr_scheduler, dataloader, ...)   # in the trainer, after the optimizer
    step, tokens_seen = ckpt.load()         # the newest complete checkpoint (or load_step, or initial_load_path)
    elapsed = ckpt.elapsed_s                # the training wall time saved with it (0.0 if none)
    ckpt.maybe_save(step, tokens_seen, elapsed_s=elapsed + ...)  # after every step: every `interval` steps, the last
    ckpt.close()                            # waits for (and commits) an async save still in flight

One checkpoint is the folder `<job.dump_folder>/<checkpoint.folder>/step-<N>/`: DCP's `.metadata` and data
files, plus `config.toml` (the resolved config, whose [model] table is compared on load) and `checksums.json` (every
file's size and CRC32s: integrity.py); folder.py names what the folder holds. Its DCP state dict:

    model         the optimizer component's model_state_dict(): this rank's share, keyed by FQN
    optimizer     the component's state_dict() (Muon momentum, AdamW moments, param groups)
    lr_scheduler  last_epoch (the schedule is a function of the config and of it: a resume whose schedule fields
                  differ from the saved config's logs one warning, lr_scheduler.schedule_change)
    dataloader    the GLOBAL data position: step and every row's [unit, document, token] of the global batch,
                  gathered from the DP ranks, so that another DP size with the same global batch resumes it
    train_state   step, tokens_seen, elapsed_s (training wall time over the runs so far; a checkpoint saved
                  before it was kept loads as 0.0)
    rng           per rank: torch (CPU, CUDA), Python and NumPy generator states; restored on the ranks that
                  existed when saving, the others keep their seeded state

Atomicity: every rank writes into `step-<N>.tmp-<id>`; once DCP's coordinator (rank 0) has written
`.metadata` (after every rank reported its files written), rank 0 writes `checksums.json` (each rank's files were
hashed by that rank as it wrote them; the records came to rank 0 with DCP's gather of the write results), fsyncs
them and renames the folder to `step-<N>` (fsync of the parent). A killed save leaves only a temporary, which
loading ignores and the next job's rank 0 deletes; keep_latest_k counts complete folders and prunes only after the
new one is in place. An async save is committed by its own thread as soon as it finishes (checksums.json too);
training waits for that only before the next save starts and at close().

`checkpoint.last_save_in_hf`: once the last step's checkpoint is committed, rank 0 converts it into the Hugging Face
folder `step-<N>-hf` beside it (convert.py, what scripts/convert_checkpoint.py runs: streamed, never the whole
model in memory), written as `step-<N>-hf.tmp-<id>` and renamed when complete; the other ranks wait for the outcome
(one gather), so that a failure is the same CheckpointError on every rank.

Damage: before loading a step, every rank checks it against its checksums.json: the sizes of all files (a stat
each, shared out among the ranks) and the CRC32s of what it will read (.metadata, the blocks holding its items);
one all_gather makes the verdict every rank's. A damaged newest step (a file truncated, deleted or changed since the
save) is named in one WARNING line, set aside as `step-<N>.damaged-<id>` when this run will save (so that neither
keep_latest_k counts it nor does it block this run's save of step N), and the run resumes from the newest intact
step before it; no intact step, or load_step / initial_load_path at a damaged one, is a CheckpointError naming the
damage. A step saved before checksums.json was kept loads unchecked (an INFO line says so).

Loading never unpickles code: `.metadata` is read by an unpickler that admits only DCP's metadata classes,
and non-tensor items are read with torch.load(weights_only=True) (dcp_io.py). Each rank reads `.metadata` once per
load: its damage check reads it and builds the state the values land in, and the load goes on with both. A missing,
partial or mismatched checkpoint raises CheckpointError (a ConfigError: train.py exits 2), naming the folder and the
mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from titan_dmuon.components.lr_scheduler import schedule_change
from titan_dmuon.config import ConfigError, JobConfig, dump_toml, load_toml
from titan_dmuon.dtypes import to_dtype
from titan_dmuon.parallel.runtime import new_group_with_timeout, raised_collective_timeout

from .convert import export_dcp_to_hf
from .dcp_io import METADATA, METADATA_ERRORS, SafeLoadPlanner, SafeReader, read_metadata
from .folder import CONFIG, DAMAGED, MODEL_ONLY, STEP_DIR, TEMP_DIR, complete_steps, fsync, step_folders
from .hf_io import load_hf_weights
from .integrity import (
    MANIFEST,
    ChecksummingWriter,
    DamagedError,
    check_blocks,
    check_sizes,
    read_manifest,
    write_manifest,
)
from .memory import local_bytes, memory_line, memory_row, memory_summary, rss_mib
from .rng import rng_state, set_rng_state

logger = logging.getLogger(__name__)


class CheckpointError(ConfigError):
    """A missing, partial or mismatched checkpoint: like a config error, the same on every rank, exit 2."""


def check_async_mode(cfg: JobConfig) -> None:
    """async_with_pinned_mem needs CUDA: a fact of this machine, so checked here rather than in the [checkpoint]
    section's validate() (which holds the other checkpoint checks), before any process group exists."""
    if cfg.checkpoint.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
        raise ConfigError(
            'checkpoint.async_mode = "async_with_pinned_mem" needs CUDA (pinned host memory); '
            'use "async" on this machine'
        )


# ------------------------------------------------------------------------------------------- the manager
@dataclass
class _StepRead:
    """What this rank's damage check (`CheckpointManager._verify_step`) read of a step folder, handed on to the load
    (`_load_dcp`) so that `.metadata` is read, and the state to load into built, once per load."""

    metadata: Metadata | None = None
    error: str | None = None
    """Why `.metadata` could not be read (the load's CheckpointError message), when it could not."""
    model_only: bool = False
    """What `template` was built for: the model (and train state) alone, or the whole state."""
    template: dict[str, Any] | None = None
    """`_template(metadata, model_only)`: the live state's layout, which the loaded values land in."""


def _read_step(path: Path) -> _StepRead:
    """Step folder `path`'s `.metadata`, or why it cannot be read."""
    try:
        return _StepRead(metadata=read_metadata(path))
    except METADATA_ERRORS as e:
        return _StepRead(error=f"checkpoint {path}: unreadable {METADATA} ({type(e).__name__}: {e})")


class CheckpointManager:
    """Saves and loads the run's state (module docstring); every rank calls every method at the same step."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        optim,
        lr_scheduler,
        dataloader,
        dp_rank: int,
        dp_world_size: int,
        global_batch_size: int,
        device: torch.device,
        seed: int,
    ):
        self.cfg, self.c = cfg, cfg.checkpoint
        self.optim, self.lr_scheduler, self.dataloader = optim, lr_scheduler, dataloader
        self.dp_rank, self.dp_world_size, self.global_batch_size = dp_rank, dp_world_size, global_batch_size
        self.device, self.seed = device, seed
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # rank 0's absolute path: a relative dump folder means the same folder on every rank, whatever its cwd
        self.folder = Path(self._broadcast_object(str((Path(cfg.job.dump_folder) / self.c.folder).resolve())))
        self.loaded_step: int | None = None
        self.saved_step: int | None = None  # the step of the last save this run started (or found already saved)
        self.saved_model_only = False
        self._tokens_seen = 0
        self.elapsed_s = 0.0
        """The training wall time saved with the checkpoint `load` loaded (0.0 without one, for weights only, or
        from a checkpoint saved before train_state.elapsed_s was kept)."""
        self._pending: Future | None = None  # the async save in flight, done once committed
        self._pg = None
        if self.c.enable and self.c.async_mode != "disabled":
            # the save thread's collectives run beside the training step's: they need a group of their own,
            # bounded by checkpoint.timeout_seconds (not lowered to comm.train_timeout_seconds after step 1)
            self._pg = new_group_with_timeout(self.c.timeout_seconds)
        self._stager = None  # async_with_pinned_mem: one DefaultStager (its pinned buffers) for every save
        self._shared_checked = False  # the first save checks that every rank sees the folder
        self.saved_config: JobConfig | None = None
        """Rank 0: the config the checkpoint this run resumes from was saved with (its step folder's config.toml)."""
        self.memory: list[dict[str, Any]] = []
        """Per save/load on this rank: RSS before, peak RSS after, this rank's state bytes (also logged)."""
        if self.c.enable and self.c.last_save_in_hf:
            self._check_hf_export()

    # -------------------------------------------------------------------------------------- collectives
    def _broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _agree(self, error: str | None) -> None:
        """Raise the first rank's error on every rank (so no rank enters a DCP collective alone)."""
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e), None)
        if first:
            raise CheckpointError(first)

    # ---------------------------------------------------------------------------------------- the state
    def _dataloader_state(self) -> dict[str, torch.Tensor]:
        """The global position: every row of the global batch, gathered from the DP ranks (TP ranks agree)."""
        pos = self.dataloader.position()
        rows = torch.tensor([[j, *s] for j, s in sorted(pos["rows"].items())], dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(rows) for _ in range(self.world_size)]
        dist.all_gather(gathered, rows)
        table = torch.full((self.global_batch_size, 3), -1, dtype=torch.int64)
        for part in gathered:
            part = part.cpu()
            table[part[:, 0]] = part[:, 1:]
        if (table < 0).any():
            raise RuntimeError("the data loader position misses rows of the global batch")
        return {"step": torch.tensor(pos["step"]), "rows": table}

    def _state_dict(self, step: int, tokens_seen: int, model_only: bool, elapsed_s: float = 0.0) -> dict[str, Any]:
        sd: dict[str, Any] = {
            "model": self.optim.model_state_dict(),
            "train_state": {
                "step": torch.tensor(step),
                "tokens_seen": torch.tensor(tokens_seen),
                "elapsed_s": torch.tensor(elapsed_s, dtype=torch.float64),
            },
        }
        if model_only:
            dtype = to_dtype(self.c.export_dtype)
            sd["model"] = {k: v.detach().to(dtype) for k, v in sd["model"].items()}
            return sd
        sd["optimizer"] = self.optim.checkpoint_state_dict()
        sd["lr_scheduler"] = {"last_epoch": torch.tensor(self.lr_scheduler.last_epoch)}
        sd["dataloader"] = self._dataloader_state()
        sd["rng"] = {f"rank{self.rank}": rng_state()}
        return sd

    # ------------------------------------------------------------------------------------------- saving
    def maybe_save(self, step: int, tokens_seen: int, last: bool = False, elapsed_s: float = 0.0) -> None:
        """After step `step`: commit a finished async save; save every `interval` steps and at the last step
        (`elapsed_s`: the training wall time so far, kept in the train state)."""
        if not self.c.enable:
            return
        self._poll()
        if self.save_due(step, last):
            self.save(step, tokens_seen, model_only=last and self.c.last_save_model_only, elapsed_s=elapsed_s)
            if last and self.c.last_save_in_hf:
                self.save_hf(step)

    def save_due(self, step: int, last: bool = False) -> bool:
        """Whether `maybe_save` saves after step `step`: every `interval` steps and at the last step, unless that
        step is the one this run loaded."""
        return self.c.enable and (step % self.c.interval == 0 or last) and step != self.loaded_step

    def save_for_stop(self, step: int, tokens_seen: int, elapsed_s: float = 0.0) -> bool:
        """A stop signal ended the run after `step`: make sure a full checkpoint of that step exists (save it unless
        this step's periodic save already did), wait for it to be committed; whether one exists (not without
        checkpoint.enable)."""
        if not self.c.enable:
            return False
        if self.saved_step != step or self.saved_model_only:
            self.save(step, tokens_seen, elapsed_s=elapsed_s)
        self._finish_pending()
        return self.saved_step == step

    def save(self, step: int, tokens_seen: int, model_only: bool = False, elapsed_s: float = 0.0) -> None:
        # A rank may wait in a save's collectives for a slower writer, and every rank for rank 0's commit
        # (fsync, rename, prune): bounded by checkpoint.timeout_seconds, not by comm.train_timeout_seconds.
        with raised_collective_timeout(self.c.timeout_seconds):
            self._save(step, tokens_seen, model_only, elapsed_s)

    def _save(self, step: int, tokens_seen: int, model_only: bool, elapsed_s: float = 0.0) -> None:
        self._finish_pending()
        final = self.folder / f"step-{step}"
        temp, error = None, None
        if self.rank == 0:
            if final.exists():
                logger.warning("checkpoint: %s exists already; not overwriting it (this save is skipped)", final)
            else:
                temp = self.folder / f"step-{step}.tmp-{uuid.uuid4().hex[:12]}"
                try:
                    temp.mkdir(parents=True)
                    (temp / CONFIG).write_text(dump_toml(self._resolved_config()))
                    if model_only:
                        (temp / MODEL_ONLY).write_text("model weights only (checkpoint.last_save_model_only)\n")
                except OSError as e:  # told to every rank, which would otherwise wait for rank 0 in DCP
                    shutil.rmtree(temp, ignore_errors=True)
                    error = f"checkpoint: cannot write {temp} ({type(e).__name__}: {e}); check checkpoint.folder"
        temp, error = self._broadcast_object((None if temp is None else str(temp), error))
        if error:
            raise CheckpointError(error)
        self.saved_step, self.saved_model_only = step, model_only
        if temp is None:
            return
        temp = Path(temp)
        if not self._shared_checked:
            self._check_shared(temp, remove=temp)
            self._shared_checked = True
        rss_before, peak_before = rss_mib()
        t0 = time.perf_counter()
        state = self._state_dict(step, tokens_seen, model_only, elapsed_s)
        share = local_bytes(state)
        writer = ChecksummingWriter(temp, sync_files=True)  # hashes every file as it writes it
        if self._pg is None:
            dcp.save(state, storage_writer=writer)
            self._commit(temp, final, step, t0, writer)
            self._record("save", step, rss_before, peak_before, share, gather=True)
        else:
            kwargs: dict[str, Any] = {}
            if self.c.async_mode == "async_with_pinned_mem":
                if self._stager is None:  # pinned buffers allocated once and reused (the previous save is done)
                    self._stager = staging.DefaultStager(staging.StagingOptions(True, False, False, False))
                kwargs["async_stager"] = self._stager
            future = dcp.async_save(state, storage_writer=writer, process_group=self._pg, **kwargs)
            self._pending = self._commit_when_done(future, temp, final, step, t0, writer)
            self._record("save (staged)", step, rss_before, peak_before, share, gather=False)

    # ---------------------------------------------------------------------------------- Hugging Face export
    def _check_hf_export(self) -> None:
        """Before training: what last_save_in_hf needs at the end (the same answer on every rank)."""
        spec = self.optim.spec
        if spec.state_dict_adapter is None:
            raise CheckpointError(
                f"checkpoint.last_save_in_hf: the model family {spec.name!r} has no Hugging Face adapter "
                "(ModelSpec.state_dict_adapter); turn last_save_in_hf off"
            )
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise CheckpointError(
                'checkpoint.last_save_in_hf needs the safetensors package: pip install -e ".[dev]" (or safetensors)'
            ) from None

    def hf_folder(self, step: int) -> Path:
        """Where last_save_in_hf writes the Hugging Face form of checkpoint `step-<step>`."""
        return self.folder / f"step-{step}-hf"

    def save_hf(self, step: int) -> None:
        """Rank 0 converts the committed checkpoint `step-<step>` into `hf_folder(step)` (the module docstring);
        every rank returns once it is written, or raises the same CheckpointError when it could not be."""
        with raised_collective_timeout(self.c.timeout_seconds):
            self._finish_pending()  # an async save: committed (step-<N> renamed) before it is read
            self._agree(self._export_hf(step) if self.rank == 0 else None)

    def _export_hf(self, step: int) -> str | None:
        """Rank 0: write hf_folder(step) from step-<step>; None, or the error message."""
        src, dst = self.folder / f"step-{step}", self.hf_folder(step)
        if dst.exists():
            logger.warning("checkpoint: %s exists already; not overwriting it (last_save_in_hf skipped)", dst)
            return None
        temp = self.folder / f"{dst.name}.tmp-{uuid.uuid4().hex[:12]}"
        t0 = time.perf_counter()
        try:
            files = export_dcp_to_hf(src, temp, self._resolved_config(), dtype=to_dtype(self.c.export_dtype))
            os.rename(temp, dst)
            fsync(self.folder)
        except Exception as e:  # any failure: every rank waits for this outcome, so it must be told, not raised here
            shutil.rmtree(temp, ignore_errors=True)
            cast = "" if self.c.export_dtype == "float32" else f" --export-dtype {self.c.export_dtype}"
            return (
                f"checkpoint.last_save_in_hf: writing {dst} from {src} failed ({type(e).__name__}: {e}); the "
                f"checkpoint itself is saved: retry with python scripts/convert_checkpoint.py {src} {dst}{cast}"
            )
        logger.info(
            "checkpoint: wrote the Hugging Face folder %s (%d safetensors file(s), the tokenizer) in %.2f s",
            dst,
            len(files),
            time.perf_counter() - t0,
        )
        return None

    def _commit_when_done(
        self, future: Future, temp: Path, final: Path, step: int, t0: float, writer: ChecksummingWriter
    ) -> Future:
        """The async save's commit, run by the save's thread as soon as the save is done: rank 0's fsync, rename
        and prune must not hold the other ranks, which train on, in their next collective."""
        committed: Future = Future()

        def commit(done: Future) -> None:
            try:
                done.result()
                self._commit(temp, final, step, t0, writer)
                committed.set_result(None)
            except BaseException as e:  # noqa: BLE001 - raised by _finish_pending in the training thread
                committed.set_exception(e)

        future.add_done_callback(commit)
        return committed

    def _poll(self) -> None:
        if self._pending is not None and self._pending.done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for the async save in flight and its commit (their errors raise here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _commit(self, temp: Path, final: Path, step: int, t0: float, writer: ChecksummingWriter) -> None:
        """Rank 0, once DCP's coordinator wrote .metadata (every rank's files are written by then): record every
        file's size and checksums (`writer.digests`, computed by the ranks that wrote them and gathered by DCP's save)
        in checksums.json, make the checkpoint visible by one rename, then prune to keep_latest_k."""
        if self.rank != 0:
            return
        if writer.digests is None:
            raise RuntimeError(f"checkpoint: the save of {temp} returned no file checksums")
        extra = [name for name in (CONFIG, MODEL_ONLY) if (temp / name).is_file()]  # rank 0's own small files
        write_manifest(temp, writer.digests, extra=extra)
        fsync(temp / METADATA)
        fsync(temp)
        os.rename(temp, final)
        fsync(self.folder)
        logger.info("checkpoint: saved %s in %.2f s", final, time.perf_counter() - t0)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest keep_latest_k full checkpoints: a model-only one neither counts nor is deleted (it
        cannot be resumed from, so it must not push out the newest one that can)."""
        if self.c.keep_latest_k <= 0:
            return
        full = [s for s in complete_steps(self.folder) if not (self.folder / f"step-{s}" / MODEL_ONLY).exists()]
        for step in full[: -self.c.keep_latest_k]:
            path = self.folder / f"step-{step}"
            doomed = self.folder / f"step-{step}.deleting-{uuid.uuid4().hex[:12]}"
            os.rename(path, doomed)  # out of sight first: a kill mid-delete leaves no partial step-<N>
            shutil.rmtree(doomed, ignore_errors=True)

    def _check_shared(self, folder: Path, remove: Path | None = None) -> None:
        """Every rank must see the file rank 0 writes in `folder` (created if absent): a checkpoint written to
        node-local disks is incomplete on each node, loads nowhere and is never cleaned up. Otherwise
        CheckpointError on every rank (rank 0 first deletes `remove`, so nothing half-written stays)."""
        if self.world_size == 1:
            return
        name, error = None, None
        if self.rank == 0:
            name = f".shared-check-{uuid.uuid4().hex[:12]}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / name).write_text("every rank must see this file\n")
            except OSError as e:
                error = f"checkpoint: cannot write in {folder} ({type(e).__name__}: {e}); check checkpoint.folder"
        name, error = self._broadcast_object((name, error))
        if error:
            raise CheckpointError(error)
        seen: list[bool | None] = [None] * self.world_size
        dist.all_gather_object(seen, (folder / name).is_file())
        if self.rank == 0:
            (folder / name).unlink(missing_ok=True)
        blind = [r for r, ok in enumerate(seen) if not ok]
        if blind:
            if self.rank == 0 and remove is not None:
                shutil.rmtree(remove, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint.folder must be on a filesystem every rank sees (resolved path {self.folder}): rank(s) "
                f"{blind} do not see the file rank 0 wrote there; put job.dump_folder on a shared filesystem"
            )

    def _resolved_config(self) -> JobConfig:
        return dataclasses.replace(self.cfg, training=dataclasses.replace(self.cfg.training, seed=self.seed))

    def _record(self, what: str, step: int, rss_before: float, peak_before: float, share: int, gather: bool) -> None:
        row = memory_row(what, step, self.rank, rss_before, peak_before, share)
        self.memory.append(row)
        rows = [row]
        if gather:
            rows = [None] * self.world_size
            dist.all_gather_object(rows, row)
        if self.rank == 0:  # one line for the job, whatever its size (every rank's row stays in `self.memory`)
            summary = memory_summary(rows)
            logger.info("%s", memory_line(summary, gathered=gather))
            logger.debug("checkpoint memory: %s", json.dumps(summary))  # the machine-readable record

    # ------------------------------------------------------------------------------------------ loading
    def clean_temporaries(self) -> None:
        """Rank 0, before this job saves anything: delete what killed saves and prunes left behind."""
        if self.rank != 0 or not self.folder.is_dir():
            return
        for entry in self.folder.iterdir():
            if TEMP_DIR.match(entry.name):
                logger.info("checkpoint: removing the unfinished %s", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def load(self) -> tuple[int, int]:
        """Resume: (step, tokens_seen) of the loaded checkpoint, or (0, 0) when there is none (or only
        initial_load_path's weights were loaded)."""
        if not self.c.enable and not self.c.initial_load_path:
            return 0, 0
        with raised_collective_timeout(self.c.timeout_seconds):
            return self._load()

    def _load(self) -> tuple[int, int]:
        if not self.c.enable:  # the folder is not this run's: start from initial_load_path only
            return self._initial_load()
        candidates = self._broadcast_object(self._choose() if self.rank == 0 else None)
        if isinstance(candidates, str):
            raise CheckpointError(candidates)
        if not candidates:
            self._check_shared(self.folder)
            self.clean_temporaries()
            if self.c.initial_load_path:
                return self._initial_load()
            logger.info("checkpoint: no checkpoint in %s, starting from scratch", self.folder)
            return 0, 0
        damaged: list[tuple[Path, str]] = []  # newer steps skipped, with what is wrong with each
        for choice in candidates:  # newest first: the newest intact step (checksums.json), every rank agreeing
            path = self.folder / f"step-{choice}"
            problem, read = self._check_step(path, model_only=False)
            if problem is None:
                break
            if self.c.load_step >= 0:  # the step asked for: no other one instead
                raise CheckpointError(
                    f"checkpoint.load_step = {choice}: {path} is damaged ({problem}); set checkpoint.load_step to "
                    "another step, or move the folder away"
                )
            damaged.append((path, problem))
        else:
            found = "; ".join(f"{p.name}: {problem}" for p, problem in damaged)
            raise CheckpointError(
                f"checkpoint: no intact checkpoint in {self.folder} ({found}): move the damaged step folder(s) away "
                "to start from scratch, or set checkpoint.load_step or checkpoint.initial_load_path"
            )
        if choice < self.cfg.training.steps:  # else nothing will be saved: leave the folder as it is
            self.clean_temporaries()
        self._skip_damaged(damaged, choice, set_aside=choice < self.cfg.training.steps)
        step = self._load_dcp(path, model_only=False, check_config=True, read=read)
        self.loaded_step = step
        return step, self._tokens_seen

    def _choose(self) -> list[int] | str:
        """Rank 0: the steps to try resuming from, newest first (load_step: that one only; none: []), or an error
        message."""
        steps = step_folders(self.folder)
        complete = complete_steps(self.folder)
        if self.c.load_step < 0:
            return sorted(steps, reverse=True)
        if self.c.load_step not in steps:
            return (
                f"checkpoint.load_step = {self.c.load_step}: {self.folder} has no step-{self.c.load_step} "
                f"(complete checkpoints: {complete or 'none'})"
            )
        newer = [s for s in steps if s > self.c.load_step]
        if newer:
            return (
                f"checkpoint.load_step = {self.c.load_step}, but {self.folder} holds later checkpoints {newer}, which "
                "this run's saves would overwrite; move them away or use another checkpoint.folder"
            )
        return [self.c.load_step]

    def _check_step(self, path: Path, model_only: bool) -> tuple[str | None, _StepRead | None]:
        """Whether every rank may load step folder `path`: each rank checks its part of it against its checksums.json
        (`_verify_step`) and one all_gather makes the decision every rank's. Returns (the damage found, or None when it
        is intact or was saved before checksums were kept: an INFO line says it is unchecked; what this rank's check
        read for the load, or None). CheckpointError when rank 0 sees neither .metadata nor checksums.json (a
        partial folder) or another rank does not see the folder at all."""
        # What `_verify_step`'s template is made of, made here on every rank before any rank's check may stop early,
        # and reused by it: a call may run collectives (torch's get_optimizer_state_dict steps a fresh optimizer, e.g.
        # muon_naive's; DMuon's scatters each TP owner's momentum into the TP shards a checkpoint holds)
        parts = (self.optim.model_state_dict(), None if model_only else self.optim.checkpoint_state_dict())
        read = None
        try:
            mine, read = self._verify_step(path, model_only, parts)
        except Exception as e:  # noqa: BLE001 - told to every rank (which would otherwise wait in the gather)
            mine = (True, f"it could not be checked ({type(e).__name__}: {e})", True)
        views: list[tuple[bool, str | None, bool] | None] = [None] * self.world_size
        dist.all_gather_object(views, mine)
        if not views[0][0]:
            raise CheckpointError(
                f"checkpoint {path} is partial or corrupted (no {METADATA}); remove it to resume from the one "
                "before, or set checkpoint.load_step"
            )
        blind = [r for r, view in enumerate(views) if not view[0]]
        if blind:
            raise CheckpointError(
                f"checkpoint.folder must be on a filesystem every rank sees (resolved path {self.folder}): rank(s) "
                f"{blind} do not see {path.name}, which rank 0 resumes from; put job.dump_folder on a shared filesystem"
            )
        found = next(((r, view[1]) for r, view in enumerate(views) if view[1]), None)
        if found is not None:
            rank, problem = found
            return (problem if self.world_size == 1 else f"{problem}, found by rank {rank}"), None
        if not views[0][2] and self.rank == 0:
            logger.info(
                "checkpoint: %s has no %s (saved before checksums were kept): loading it unchecked", path, MANIFEST
            )
        return None, read

    def _verify_step(
        self, path: Path, model_only: bool, parts: tuple[dict, dict | None]
    ) -> tuple[tuple[bool, str | None, bool], _StepRead | None]:
        """This rank's check of step folder `path`, reading no file (or block) it would not read to load it:
        ((whether it sees the folder: its checksums.json or .metadata, the damage found or None, whether it was
        checked against a checksums.json), what it read of `.metadata` for the load: None when it read none or found
        damage). The sizes of a share of the files (a stat each, every file by some rank); the checksums of .metadata
        (every rank reads it), of rank 0's config.toml and marker (rank 0 reads them) and of the blocks holding the
        bytes this rank loads (DCP's metadata, planned as dcp.load plans). A mismatch of keys or shapes is not
        damage: `_load_dcp` names it. `parts`: the (model, optimizer) state dicts its template is made of, built on
        every rank by `_check_step` (this check may stop early on one rank: it runs no collective)."""
        if not ((path / MANIFEST).is_file() or (path / METADATA).is_file()):
            return (False, None, False), None
        try:
            manifest = read_manifest(path)
        except DamagedError as e:
            return (True, str(e), True), None
        if manifest is None:
            return (True, None, False), None
        names = sorted(manifest.files)
        problem = check_sizes(path, manifest, names[self.rank :: self.world_size])
        if problem is None and METADATA not in manifest.files:
            problem = f"{MANIFEST} does not list {METADATA}"
        small = [n for n in names if n == METADATA or (self.rank == 0 and not n.endswith(".distcp"))]
        for name in small:
            problem = problem or check_blocks(path, manifest, name)
        if problem:
            return (True, problem, True), None
        read = _read_step(path)
        if read.metadata is None:
            return (True, None, True), read  # intact as saved, yet unreadable: `_load_dcp` says so
        metadata = read.metadata
        saved = metadata.state_dict_metadata
        read.model_only = model_only or not any(k.startswith("optimizer.") for k in saved)
        state = read.template = self._template(saved, read.model_only, parts)
        if self._mismatch(path, state, saved):
            return (True, None, True), read
        planner = SafeLoadPlanner()  # what dcp.load will read on this rank: (file, offset, length) of each item
        planner.set_up_planner(state, metadata, self.rank == 0)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in planner.create_local_plan().items:
            info = metadata.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        for name in sorted(ranges):
            if name not in manifest.files:
                return (True, f"{name} (which {METADATA} names) is not in {MANIFEST}", True), None
            problem = check_blocks(path, manifest, name, ranges[name])
            if problem:
                return (True, problem, True), None
        return (True, None, True), read

    def _skip_damaged(self, damaged: list[tuple[Path, str]], chosen: int, set_aside: bool) -> None:
        """Rank 0: one WARNING line per damaged step the resume skips, and (when this run will save) the step set
        aside as `step-<N>.damaged-<id>`: out of keep_latest_k's count, and not in the way of this run's save of
        that step."""
        if self.rank != 0:
            return
        for path, problem in damaged:
            where = "left as it is (this run saves nothing)"
            if set_aside:
                aside = path.with_name(f"{path.name}.{DAMAGED}-{uuid.uuid4().hex[:12]}")
                try:
                    os.rename(path, aside)
                    where = f"moved to {aside.name}: delete it once inspected"
                except OSError as e:  # this run's save of that step will be skipped: say what to do
                    where = f"it could not be moved aside ({e}): move it away before this run saves that step"
            logger.warning(
                "checkpoint: %s is damaged (%s); resuming from step-%d, the newest intact checkpoint; %s",
                path,
                problem,
                chosen,
                where,
            )
        if damaged and set_aside:
            fsync(self.folder)

    def _initial_load(self) -> tuple[int, int]:
        path = Path(self.c.initial_load_path)
        kind = self._broadcast_object(self._initial_kind(path) if self.rank == 0 else None)  # one decision
        if kind not in ("hf", "dcp"):
            raise CheckpointError(kind)
        seen: list[bool | None] = [None] * self.world_size  # each rank reads the folder itself
        dist.all_gather_object(seen, path.is_dir())
        if not all(seen):
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} is not a folder on rank(s) "
                f"{[r for r, ok in enumerate(seen) if not ok]}: it must be on a filesystem every rank sees"
            )
        if kind == "hf":
            return self._initial_load_hf(path)
        problem, read = self._check_step(path, model_only=self.c.initial_load_model_only)
        if problem is not None:  # the folder asked for: no other one instead
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} is damaged ({problem}); point it at an intact checkpoint"
            )
        step = self._load_dcp(path, model_only=self.c.initial_load_model_only, check_config=False, read=read)
        if self.c.initial_load_model_only:
            logger.info("checkpoint: started from the model weights of %s", path)
            self.elapsed_s = 0.0
            return 0, 0
        return step, self._tokens_seen

    @staticmethod
    def _initial_kind(path: Path) -> str:
        """Rank 0: "hf" (a Hugging Face folder), "dcp" (a DCP checkpoint), or the error message."""
        if not path.is_dir():
            return f"checkpoint.initial_load_path {path} is not a folder"
        if any(path.glob("*.safetensors")):
            return "hf"
        if not (path / METADATA).is_file():
            return f"checkpoint.initial_load_path {path} holds neither *.safetensors nor a DCP checkpoint ({METADATA})"
        return "dcp"

    def _initial_load_hf(self, path: Path) -> tuple[int, int]:
        """The weights of a Hugging Face folder, each rank reading its share (hf_io.py)."""
        spec = self.optim.spec
        if spec.state_dict_adapter is None:
            raise CheckpointError(
                f"checkpoint.initial_load_path {path} is a Hugging Face folder, but the model family {spec.name!r} "
                "has no Hugging Face adapter (ModelSpec.state_dict_adapter)"
            )
        sd = self.optim.model_state_dict()
        error = None
        try:
            load_hf_weights(sd, path, spec.state_dict_adapter(self.optim.model))
        except (KeyError, ValueError, OSError) as e:  # the same on every rank, or named by the rank that saw it
            error = f"checkpoint.initial_load_path {path}: {e}"
        self._agree(error)
        self.optim.load_model_state_dict(sd)
        logger.info("checkpoint: started from the Hugging Face weights in %s", path)
        return 0, 0

    def _check_config(self, path: Path) -> str | None:
        """The saved config's [model] table against this run's (another family/flavor is another model)."""
        config = path / CONFIG
        if not config.is_file():
            return f"checkpoint {path} is partial: no {CONFIG}"
        try:
            saved = load_toml(str(config))
        except (ConfigError, OSError, ValueError) as e:
            return f"checkpoint {path}: unreadable {CONFIG} ({e})"
        self.saved_config = saved
        for key in ("name", "flavor"):
            theirs, mine = getattr(saved.model, key), getattr(self.cfg.model, key)
            if theirs != mine:
                return (
                    f"checkpoint {path} was saved by another model config: model.{key} = {theirs!r} there, "
                    f"{mine!r} here"
                )
        return None

    def _load_dcp(self, path: Path, model_only: bool, check_config: bool, read: _StepRead | None) -> int:
        """Load step folder `path` (`read`: what `_check_step` read of it on this rank, None where it read nothing);
        its step."""
        rss_before, peak_before = rss_mib()
        t0 = time.perf_counter()
        error = self._check_config(path) if (check_config and self.rank == 0) else None
        if error is None:
            if read is None:  # saved before checksums were kept: the check read no .metadata
                read = _read_step(path)
            error = read.error
        self._agree(error)
        saved = read.metadata.state_dict_metadata
        has_optimizer = any(k.startswith("optimizer.") for k in saved)
        if not model_only and not has_optimizer:
            step = int(path.name.removeprefix("step-")) if STEP_DIR.match(path.name) else 0
            if check_config and step < self.cfg.training.steps:  # a resume would go on without optimizer and data
                raise CheckpointError(
                    f"checkpoint {path} holds model weights only (checkpoint.last_save_model_only), so training "
                    f"cannot continue from it to step {self.cfg.training.steps}: set checkpoint.load_step to a full "
                    "checkpoint and move this one away"
                )
            model_only = True
            logger.warning("checkpoint: %s holds model weights only; the optimizer state starts fresh", path)
        built = read.template is not None and read.model_only == model_only  # by the damage check, for this load
        state = read.template if built else self._template(saved, model_only)
        self._agree(self._mismatch(path, state, saved))
        try:
            dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        except (Exception, CheckpointException) as e:  # a missing/truncated file (DCP raises it on every rank)
            raise CheckpointError(f"checkpoint {path} could not be read ({type(e).__name__}): {e}") from None
        self.optim.load_model_state_dict(state["model"])
        step = int(state["train_state"]["step"]) if "train_state" in state else 0
        self._tokens_seen = int(state["train_state"]["tokens_seen"]) if "train_state" in state else 0
        self.elapsed_s = float(state.get("train_state", {}).get("elapsed_s", 0.0))  # absent in older checkpoints
        if not model_only:
            self.optim.load_checkpoint_state_dict(state["optimizer"])
            self._load_lr_scheduler(int(state["lr_scheduler"]["last_epoch"]))
            d = state["dataloader"]
            self.dataloader.seek(int(d["step"]), {j: d["rows"][j].tolist() for j in self.dataloader.rows})
            mine = state.get("rng", {}).get(f"rank{self.rank}")
            if mine is not None:
                set_rng_state(mine)
        logger.info("checkpoint: loaded %s (step %d) in %.2f s", path, step, time.perf_counter() - t0)
        self._record("load", step, rss_before, peak_before, local_bytes(state), gather=True)
        return step

    def _template(
        self, saved: dict[str, Any], model_only: bool, parts: tuple[dict, dict | None] | None = None
    ) -> dict[str, Any]:
        """What to load into: the live state's layout (the loaded values land in it); `parts`: the (model, optimizer)
        state dicts to use, already built (else built here: every rank must call it then)."""
        model_sd, optim_sd = parts if parts is not None else (self.optim.model_state_dict(), None)
        state: dict[str, Any] = {"model": model_sd}
        if "train_state.step" in saved:
            state["train_state"] = {"step": torch.tensor(0), "tokens_seen": torch.tensor(0)}
            if "train_state.elapsed_s" in saved:  # older checkpoints have no elapsed_s: it starts from 0
                state["train_state"]["elapsed_s"] = torch.tensor(0.0, dtype=torch.float64)
        if model_only:
            return state
        state["optimizer"] = optim_sd if optim_sd is not None else self.optim.checkpoint_state_dict()
        state["lr_scheduler"] = {"last_epoch": torch.tensor(0)}
        state["dataloader"] = {
            "step": torch.tensor(0),
            "rows": torch.zeros(self.global_batch_size, 3, dtype=torch.int64),
        }
        if f"rng.rank{self.rank}.torch" in saved:
            rng = rng_state()
            state["rng"] = {f"rank{self.rank}": {k: v for k, v in rng.items() if f"rng.rank{self.rank}.{k}" in saved}}
        return state

    def _mismatch(self, path: Path, state: dict[str, Any], saved: dict[str, Any]) -> str | None:
        """This rank's template against the checkpoint's keys, shapes and kinds; None when it fits."""
        flat, _ = flatten_state_dict(state)
        missing, shapes = [], []
        for key, value in flat.items():
            md = saved.get(key)
            if md is None:
                missing.append(key)
            elif isinstance(value, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    shapes.append(f"{key}: a tensor here, an object there")
                elif tuple(md.size) != tuple(value.shape):
                    shapes.append(f"{key}: {tuple(md.size)} there, {tuple(value.shape)} here")
            elif not isinstance(md, BytesStorageMetadata):
                shapes.append(f"{key}: an object here, a tensor there")
        problems = []
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(f"missing keys {missing[:5]}{more}")
        if shapes:
            problems.append("shape differences " + "; ".join(shapes[:5]))
        if not problems:
            return None
        hint = ""
        if any(k.startswith("dataloader.rows") for k in shapes):
            hint = " (the data position needs the same global batch: local_batch_size x DP ranks x accumulation)"
        return f"checkpoint {path} does not match this run: {', '.join(problems)}{hint}"

    def _load_lr_scheduler(self, last_epoch: int) -> None:
        """The schedule at `last_epoch`: each group's lr as LambdaLR.step computes it. The schedule is this run's
        config's: on a resume whose schedule fields differ from the saved config's, rank 0 says so (once)."""
        s = self.lr_scheduler
        s.last_epoch = last_epoch
        s._step_count = last_epoch + 1
        lrs = [base * fn(last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas, strict=True)]
        for group, lr in zip(s.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        s._last_lr = lrs
        if self.rank == 0 and self.saved_config is not None and last_epoch < self.cfg.training.steps:
            self._warn_schedule_change(last_epoch)

    def _warn_schedule_change(self, last_epoch: int) -> None:
        """Rank 0, on a resume (saved_config read): other schedule fields than the saved config's move the lr from
        the next step on; one warning names them, with each kind's lr before and after."""
        lrs: dict[str, float] = {}
        for group in self.lr_scheduler.optimizer.param_groups:
            kind = group.get("kind")
            if kind is not None and hasattr(self.cfg.optimizer, kind):  # its base lr is [optimizer.<kind>].lr
                lrs.setdefault(kind, group["lr"])  # the lr the next step trains at
        line = schedule_change(self.saved_config, self.cfg, last_epoch, lrs)
        if line:
            logger.warning("%s", line)

    # ---------------------------------------------------------------------------------------------- end
    def close(self, graceful: bool = True) -> None:
        """Finish (and commit) an async save in flight; without `graceful`, leave it uncommitted."""
        if graceful:
            self._finish_pending()
            if self._stager is not None:  # its pinned buffers; not while an abandoned save may still read them
                self._stager.close()
                self._stager = None
        self._pending = None


__all__ = ["CheckpointError", "CheckpointManager", "check_async_mode"]
