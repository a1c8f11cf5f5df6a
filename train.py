"""Train a model: python train.py --config train_configs/debug_model.toml [--section.field value ...]

Multi-process: torchrun --standalone --nproc_per_node N train.py --config ... (or ./run_train.sh).
Plan a cluster from this machine: --job.dry_run --job.dry_run_world_size N or --job.dry_run_nodes M
(titan_dmuon/planner/).
Multi-node: scripts/multinode_trainer.slurm (sbatch); docs/training.md, Launching.
Exit status: 0 done, 1 training diverged (NaN/inf loss or grad norm) or failed (also when a peer rank died or hung:
a collective timed out, comm.*_timeout_seconds), 2 configuration error, 128 + N stopped by signal N (143 SIGTERM,
138 SIGUSR1, 130 SIGINT) after saving a checkpoint of the step reached (titan_dmuon/parallel/preemption.py): rerun
to resume.
"""

from __future__ import annotations

import logging
import sys

from titan_dmuon.config import ConfigError, parse_args_or_exit, report_config_error

logger = logging.getLogger("train")


def main(argv: list[str] | None = None) -> int:
    """The run's exit status, through `exit_status.report` (which our launchers read)."""
    from titan_dmuon.exit_status import register, report
    from titan_dmuon.preflight import check_paths

    register()  # under a launcher: its signals come to this process, not to torchrun
    # Exits 2 naming the key on a config error or a missing path (data, tokenizer, weights), before torch is imported.
    cfg = parse_args_or_exit(argv, check=check_paths)
    if cfg.job.dry_run:
        return _dry_run(cfg)
    try:
        return report(*_train(cfg))
    except ConfigError as e:  # the trainer is closed by now; a launcher prints each distinct message once
        return report_config_error(e)


def _train(cfg) -> tuple[int, str | None]:
    """(exit status, the one-line message to print for it, if not logged already); a ConfigError propagates."""
    from titan_dmuon.parallel.failures import CommFailureError
    from titan_dmuon.parallel.preemption import StopRequested
    from titan_dmuon.trainer import Trainer, TrainingDivergedError, set_up_logging

    set_up_logging()
    trainer, graceful = None, False
    try:
        trainer = Trainer(cfg)
        trainer.train()
        graceful = True
    except ConfigError:  # reported by main
        graceful = True
        raise
    except StopRequested as e:  # a stop signal: every rank stopped after the same step, saved
        graceful = True
        if trainer.rank == 0:
            logger.warning("%s", e)
        return e.exit_code, None
    except TrainingDivergedError as e:  # every rank stops at the same step
        graceful = True
        logger.error("%s", e)  # every rank logs it (ERROR passes the non-zero ranks' WARNING level)
        return 1, None
    except CommFailureError as e:  # a peer died or hung: say who saw it and whom the heartbeat names, no traceback
        logger.error("%s", e)
        return 1, None  # torchrun stops this node's other ranks, srun --kill-on-bad-exit=1 the other nodes
    finally:  # anything else propagates (traceback, exit 1; torchrun stops the other ranks)
        if trainer is not None:
            trainer.close(graceful=graceful)
    return 0, None


def _dry_run(cfg) -> int:
    """--job.dry_run: plan the run on a fake process group (titan_dmuon/planner/) and exit."""
    from titan_dmuon.planner import dry_run
    from titan_dmuon.trainer import set_up_logging

    set_up_logging(rank=0)
    try:
        return dry_run(cfg)
    except ConfigError as e:
        return report_config_error(e)


if __name__ == "__main__":
    sys.exit(main())
