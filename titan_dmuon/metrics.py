"""Training metrics: one console line and TensorBoard scalars (and text), written by rank 0 only.

Scalar names are TensorBoard tags ("loss/train", "grad_norm", "lr/muon", "lr/adamw", "progress/tokens_seen",
"progress/elapsed_s", "throughput/tokens_per_sec", "mfu", "throughput/tflops", "memory/...", and the optimizer
component's own, e.g. "dmuon/..."); the console line picks the common ones it knows.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable

import torch

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
    tokens: int, seconds: float, flops_per_token: int, peak_flops: float | None = None
) -> dict[str, float]:
    """Tokens/s and achieved TFLOP/s for `tokens` processed in `seconds` on one rank; MFU (%) when the
    device's peak is known."""
    tps = tokens / seconds
    out = {"throughput/tokens_per_sec": tps, "throughput/tflops": tps * flops_per_token / 1e12}
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


class MetricsLogger:
    """Console (logging) + TensorBoard on rank 0; on other ranks every call is a no-op.

    ETA comes from the wall time between the first and the latest `log` call, so the first steps
    (compilation, warmup) do not skew it.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        dump_folder: str,
        rank: int = 0,
        total_steps: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.enabled = rank == 0
        self.total_steps = total_steps
        self._clock = clock
        self._first: tuple[int, float] | None = None
        self.writer = None
        if self.enabled and cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.log_dir = os.path.join(dump_folder, cfg.save_tb_folder)
            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = SummaryWriter(log_dir=self.log_dir)
            logger.info("TensorBoard events in %s", self.log_dir)

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
        """Write every scalar as a TensorBoard tag at `step` and log one console line."""
        if not self.enabled:
            return
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, float(value), step)
            self.writer.flush()
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
        """`step:  5/30  loss: 2.3456  grad_norm: 1.2346  lr_muon: 1.00e-02  lr_adamw: 3.00e-03  tps: 12,345 ...`.

        Each `lr/<kind>` scalar shows as `lr_<kind>`, in the order given."""
        parts = [f"step: {step:>4}" + (f"/{total_steps}" if total_steps is not None else "")]
        lrs = [(key, key.replace("/", "_")) for key in scalars if key == "lr" or key.startswith("lr/")]
        fmt = [
            ("loss/train", "loss", "{:.4f}"),
            ("grad_norm", "grad_norm", "{:.4f}"),
            *[(key, label, "{:.2e}") for key, label in lrs],
            ("throughput/tokens_per_sec", "tps", "{:,.0f}"),
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
