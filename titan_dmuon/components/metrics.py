"""Training metrics: one console line and TensorBoard scalars (and text), written by rank 0 only.

Scalar names are TensorBoard tags ("loss/train", "grad_norm", "lr/muon", "lr/adamw", "progress/tokens_seen",
"progress/elapsed_s", "throughput/tokens_per_sec" (per rank), "throughput/tokens_per_sec_global", "mfu",
"throughput/tflops", "time/optimizer_share", "memory/...", and the optimizer component's own, e.g. "dmuon/..."
(max over ranks) and "dmuon_mean/..." (mean over ranks)); the console line picks the common ones it knows. With
`metrics.enable_wandb`, the same scalars go to Weights & Biases under the same names and steps (`wandb` is imported
only then: it is an optional extra).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from titan_dmuon.config import ConfigError
from titan_dmuon.config import Metrics as MetricsConfig

logger = logging.getLogger(__name__)

_GIB = 1024**3

# Dense bf16 peak FLOP/s by GPU name substring, most specific first.
_PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its device name, None when unknown."""
    for key, flops in _PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def get_peak_flops(device: torch.device | str) -> float | None:
    """Peak bf16 FLOP/s of `device` for MFU; None on CPU or an unknown GPU (MFU is then not reported)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    flops = peak_flops_for_name(name)
    if flops is None:
        logger.warning("unknown peak FLOP/s for GPU %r: MFU will not be reported", name)
    return flops


def throughput_metrics(
    tokens: float, seconds: float, flops_per_token: int, peak_flops: float | None = None, ranks: int = 1
) -> dict[str, float]:
    """Tokens/s and achieved TFLOP/s for `tokens` processed in `seconds` on one rank (device); the global
    tokens/s of `ranks` ranks that each process as many; MFU (%) when the device's peak is known."""
    tps = tokens / seconds
    out = {
        "throughput/tokens_per_sec": tps,
        "throughput/tokens_per_sec_global": tps * ranks,
        "throughput/tflops": tps * flops_per_token / 1e12,
    }
    if peak_flops:
        out["mfu"] = 100.0 * tps * flops_per_token / peak_flops
    return out


def device_memory_stats(device: torch.device | str, reset_peak: bool = False) -> dict[str, float]:
    """Peak CUDA memory (GiB and % of the device) on CUDA; process RSS (current and peak) on CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        stats = {
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB,
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
        }
        total = torch.cuda.get_device_properties(device).total_memory
        stats["memory/max_reserved_pct"] = 100.0 * stats["memory/max_reserved_gib"] * _GIB / total
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return stats
    stats = {}
    try:
        with open("/proc/self/statm") as f:
            stats["memory/rss_gib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _GIB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        stats["memory/max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB  # KiB on Linux
    except (ImportError, OSError):
        pass
    return stats


class SectionTimer:
    """Seconds spent in `with timer.section():` (e.g. each step's optimizer step), summed until `read()`.

    On CUDA each section records a pair of timing events on the current stream, read only by `read()` (which
    waits for the last one): the steps in between never wait for the device. Elsewhere, perf_counter."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def read(self) -> float:
        """The seconds of the sections since the last `read()` (one device sync on CUDA), and start again at 0."""
        seconds, self._seconds = self._seconds, 0.0
        if self._events:
            events, self._events = self._events, []
            events[-1][1].synchronize()
            seconds += sum(start.elapsed_time(end) for start, end in events) / 1e3
        return seconds


def max_and_mean_over_ranks(
    values: dict[str, float],
    keys: Sequence[str],
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each of `keys` over the ranks of `group` (default: all): (max, mean), from ONE all_gather of a
    [len(keys)] float64 vector. A key missing from `values` on a rank (NaN there) counts over the ranks that
    have it, and is left out of both dicts when no rank has it. Every rank of `group` must call this with the
    same `keys`, in the same order; one rank (or no process group) needs no collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        present = {k: float(values[k]) for k in keys if k in values}
        return present, dict(present)
    local = torch.tensor([float(values.get(k, math.nan)) for k in keys], dtype=torch.float64, device=device)
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, local, group=group)
    table = torch.stack(rows).cpu()  # [ranks, keys]
    have = ~torch.isnan(table)
    counts = have.sum(0)
    maxes = torch.where(have, table, -math.inf).amax(0)
    means = torch.where(have, table, 0.0).sum(0) / counts.clamp(min=1)
    out_max, out_mean = {}, {}
    for i, key in enumerate(keys):
        if counts[i] > 0:
            out_max[key], out_mean[key] = float(maxes[i]), float(means[i])
    return out_max, out_mean


WANDB_RUN_ID_FILE = "wandb_run_id"  # under job.dump_folder: the W&B run a resumed run logs into
_WANDB_MISSING = (
    "metrics.enable_wandb needs the wandb package, which is not installed: pip install 'titan_dmuon[wandb]' "
    "(or pip install wandb), or set metrics.enable_wandb = false"
)


def check_wandb_installed() -> None:
    """ConfigError naming the fix unless the wandb package can be imported; imports nothing (every rank can call
    it, so that all of them stop with the same message)."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except ValueError:  # an entry without a spec in sys.modules
        found = False
    if not found:
        raise ConfigError(_WANDB_MISSING)


def import_wandb():
    """The wandb module, or ConfigError naming the fix."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(_WANDB_MISSING) from None
    return wandb


def wandb_run_id(dump_folder: str, resumed: bool) -> str:
    """The W&B run id for a run writing to `dump_folder`: $WANDB_RUN_ID when set; else, for a resumed run, the id
    an earlier run of the folder saved in `<dump_folder>/wandb_run_id`; else a new one, saved there for the runs
    that resume this one (a requeued job, a rerun after a stop). A run from scratch gets a new W&B run, as its
    TensorBoard curves restart at step 1."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    path = os.path.join(dump_folder, WANDB_RUN_ID_FILE)
    if resumed:
        try:
            with open(path) as f:
                run_id = f.read().strip()
            if run_id:
                return run_id
        except FileNotFoundError:  # its earlier runs did not log to W&B
            pass
    run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f], valid in a W&B run id
    os.makedirs(dump_folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def start_wandb_run(cfg: MetricsConfig, dump_folder: str, job_config: Any = None, purge_step: int | None = None):
    """`wandb.init` for rank 0 (see `MetricsLogger`); ConfigError when wandb is missing or refuses to start (not
    logged in, no network: WANDB_MODE=offline logs locally)."""
    wandb = import_wandb()
    run_id = wandb_run_id(dump_folder, resumed=purge_step is not None and purge_step > 1)
    try:
        run = wandb.init(
            project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "titan_dmuon",
            entity=cfg.wandb_entity or None,  # None: $WANDB_ENTITY, else the login's default
            name=cfg.wandb_run_name or None,  # None: $WANDB_NAME, else W&B's
            id=run_id,
            resume="allow",  # this id's run goes on if it exists, else it starts
            dir=os.environ.get("WANDB_DIR") or dump_folder,  # W&B adds its own "wandb" folder under it
            config=dataclasses.asdict(job_config) if job_config is not None else None,
        )
    except wandb.errors.Error as e:
        raise ConfigError(
            f"metrics.enable_wandb: W&B could not start run {run_id!r}: {e} (log in with `wandb login` or set "
            "WANDB_API_KEY; WANDB_MODE=offline logs locally for a later `wandb sync`)"
        ) from None
    logger.info("W&B run %s (project %s) in %s", run.id, run.project, os.path.dirname(run.dir))
    return run


class MetricsLogger:
    """Console (logging) + TensorBoard on rank 0, and Weights & Biases with `cfg.enable_wandb`; on other ranks every
    call is a no-op.

    ETA comes from the wall time between the first and the latest `log` call, so the first steps
    (compilation, warmup) do not skew it.

    `purge_step`: the first step this run logs (the resumed step + 1). The TensorBoard folder may hold events at
    or past it from an earlier run (one killed after logging steps it never saved, or resumed from an older
    checkpoint): the writer marks a restart there (SummaryWriter's `purge_step`), so TensorBoard drops them and
    every step shows once, with the value of the run that last computed it.

    W&B (`cfg.enable_wandb`): every rank first checks that wandb is installed (ConfigError naming the fix: all ranks
    stop alike); rank 0 starts a run whose config is `job_config` (the resolved JobConfig) as a nested dict, with its
    files under `<dump_folder>/wandb` ($WANDB_DIR/wandb when set). A resumed run (`purge_step` > 1) goes on with the
    W&B run id saved in `<dump_folder>/wandb_run_id` (`resume="allow"`); a run from scratch starts a new W&B run.
    W&B cannot rewrite a step (online, a resumed run drops the steps up to the last one it has): the steps an earlier
    run logged past the checkpoint it was resumed from keep that run's values there (TensorBoard shows the rerun's).
    Text entries (`log_text`: the config) go to TensorBoard only: W&B has the config as the run's config. `close`
    finishes the run.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        dump_folder: str,
        rank: int = 0,
        total_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        purge_step: int | None = None,
        job_config: Any = None,
    ) -> None:
        self.enabled = rank == 0
        self.total_steps = total_steps
        self._clock = clock
        self._first: tuple[int, float] | None = None
        self.writer = None
        self.wandb_run = None
        if cfg.enable_wandb:
            check_wandb_installed()
        if self.enabled and cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir = os.path.join(dump_folder, cfg.save_tb_folder)
            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge_step)
            logger.info("TensorBoard events in %s", self.log_dir)
        if self.enabled and cfg.enable_wandb:
            try:
                self.wandb_run = start_wandb_run(cfg, dump_folder, job_config, purge_step)
            except BaseException:  # e.g. the ConfigError of a W&B that cannot start: no writer left open
                self.close()
                raise

    def _eta_seconds(self, step: int) -> float | None:
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
            return None
        first_step, first_time = self._first
        if self.total_steps is None or step <= first_step:
            return None
        return (now - first_time) / (step - first_step) * max(0, self.total_steps - step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Write every scalar as a TensorBoard tag (and W&B key) at `step` and log one console line."""
        if not self.enabled:
            return
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, float(value), step)
            self.writer.flush()
        if self.wandb_run is not None:  # the row is written when a later step comes or at close
            self.wandb_run.log({tag: float(value) for tag, value in scalars.items()}, step=step)
        logger.info(self.format_line(step, scalars, self._eta_seconds(step), self.total_steps))

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        """A TensorBoard text entry (Markdown: indent `text` four spaces to show it verbatim)."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
            self.writer.flush()

    @staticmethod
    def format_line(
        step: int, scalars: dict[str, float], eta_s: float | None = None, total_steps: int | None = None
    ) -> str:
        """`step:  5/30  loss: 2.3456  grad_norm: 1.2346  lr_muon: 1.00e-02  lr_adamw: 3.00e-03  tps/rank: 12,345
        tokens/s: 98,760 ...`.

        Each `lr/<kind>` scalar shows as `lr_<kind>`, in the order given. `tps/rank` is one rank's (device's)
        tokens per second, `tokens/s` all ranks' together."""
        parts = [f"step: {step:>4}" + (f"/{total_steps}" if total_steps is not None else "")]
        lrs = [(key, key.replace("/", "_")) for key in scalars if key == "lr" or key.startswith("lr/")]
        fmt = [
            ("loss/train", "loss", "{:.4f}"),
            ("grad_norm", "grad_norm", "{:.4f}"),
            *[(key, label, "{:.2e}") for key, label in lrs],
            ("throughput/tokens_per_sec", "tps/rank", "{:,.0f}"),
            ("throughput/tokens_per_sec_global", "tokens/s", "{:,.0f}"),
            ("progress/tokens_seen", "tokens", "{:,.0f}"),
            ("mfu", "mfu", "{:.2f}%"),
            ("throughput/tflops", "tflops", "{:.3f}"),
            ("loss/validation", "val_loss", "{:.4f}"),
            ("perplexity/validation", "val_ppl", "{:.2f}"),
            ("dmuon/publish_wait_p90_us", "publish_wait_p90", "{:.0f}us"),  # HSDP async publish: < 100 us = hidden
        ]
        for key, label, spec in fmt:
            if key in scalars:
                parts.append(f"{label}: {spec.format(scalars[key])}")
        if "memory/max_reserved_gib" in scalars:
            mem = f"memory: {scalars['memory/max_reserved_gib']:.2f}GiB"
            if "memory/max_reserved_pct" in scalars:
                mem += f" ({scalars['memory/max_reserved_pct']:.1f}%)"
            parts.append(mem)
        elif "memory/rss_gib" in scalars:
            parts.append(f"rss: {scalars['memory/rss_gib']:.2f}GiB")
        if "progress/elapsed_s" in scalars:
            parts.append(f"elapsed: {datetime.timedelta(seconds=round(scalars['progress/elapsed_s']))}")
        if eta_s is not None:
            parts.append(f"eta: {datetime.timedelta(seconds=round(eta_s))}")
        return "  ".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish()
