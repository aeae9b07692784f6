"""``python -m lowmem.train +recipe=wrn_cifar [overrides]``: compose, build, fit, write the run files.

Run files (SPEC §2), in Hydra's run directory: .hydra/config.yaml, metrics.jsonl, result.json,
model.pt (plain state_dict), checkpoint.pt (resumable with ``trainer.resume=<run dir>``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lowmem import distributed
from lowmem.config import ConfigError, register_configs
from lowmem.run import records
from lowmem.run.command import one_line_errors, refuse_unknown_knobs
from lowmem.run.files import CHECKPOINT, METRICS, RESULT, read_checkpoint, set_aside_metrics
from lowmem.run.refusals import exit_refused

log = logging.getLogger("lowmem")
register_configs()


def comparable_config(config: dict) -> dict:
    """A run's configuration without the knobs that do not change what it computes."""
    config = json.loads(json.dumps(config))
    for knob in ("resume", "progress", "log_every"):
        config.get("trainer", {}).pop(knob, None)
    return config


def previous_run(cfg: DictConfig, run_dir: Path) -> str | None:
    """What ``run_dir`` already holds: "finished", "interrupted" (same configuration) or None.

    A directory holding another configuration's files is refused: nothing already written is
    overwritten. Re-running a sweep therefore skips finished runs and continues interrupted ones.
    """
    if cfg.trainer.resume:
        return None
    mine = comparable_config(OmegaConf.to_container(cfg, resolve=True))
    for name, state in ((RESULT, "finished"), (CHECKPOINT, "interrupted")):
        path = run_dir / name
        if not path.is_file():
            continue
        if name == RESULT:
            theirs = json.loads(path.read_text()).get("config", {})
        else:
            refusal = (
                f"hydra.run.dir={run_dir} holds an interrupted run that cannot be continued (move its "
                f"{CHECKPOINT} away to start afresh, or choose another hydra.run.dir)"
            )
            theirs = read_checkpoint(path, refusal).get("config", {})
        if comparable_config(theirs) != mine:
            raise ConfigError(
                f"hydra.run.dir={run_dir} already holds {name} of a different configuration; choose another "
                f"directory (or trainer.resume={run_dir} to continue that run)"
            )
        return state
    return None


def run(cfg: DictConfig, run_dir: Path) -> dict:
    from lowmem.trainer import build_trainer, resolve_device, resume_from

    try:
        state = (
            previous_run(cfg, run_dir)
            if distributed.is_rank0() or not distributed.launched_by_torchrun()
            else None
        )
    except ConfigError:
        records.restore(run_dir)  # the refused job's .hydra files must not replace the run's
        raise
    if state == "finished":
        records.restore(run_dir)
        log.info("%s already holds the finished result of this configuration: skipped", run_dir)
        return json.loads((run_dir / RESULT).read_text())
    distributed.init_from_environment(resolve_device(cfg.trainer.device))
    # Rank 0 read the run directory: every rank continues an interrupted run (loading a checkpoint
    # is collective when the state is sharded, and every rank must hold it either way).
    state, source = distributed.gather_objects((state, str(run_dir)))[0]
    trainer = build_trainer(cfg)
    if state == "interrupted":
        log.info("%s holds an interrupted run of this configuration: continuing it", run_dir)
        resume_from(trainer, source, run_dir)
    elif cfg.trainer.resume:
        resume_from(trainer, cfg.trainer.resume, run_dir)
        log.info(
            "resumed from %s at epoch %d, step %d",
            cfg.trainer.resume,
            trainer.state.epoch,
            trainer.state.step,
        )
    elif distributed.is_rank0():
        # Starting afresh: metrics left here by a run killed before its first checkpoint are not this run's.
        aside = set_aside_metrics(run_dir)
        if aside is not None:
            log.warning(
                "%s held the metrics of a run stopped before its first checkpoint (nothing to resume): moved to "
                "%s; this run starts afresh", run_dir / METRICS, aside.name,
            )
    result = trainer.fit(run_dir)
    metric = trainer.recipe.primary_metric
    if distributed.is_rank0():
        log.info(
            "done: best %s %.4f, final %.4f, %d steps in %.1fs, measured peak %s bytes -> %s",
            metric,
            result[f"best_{metric}"],
            result[f"final_{metric}"],
            result["steps"],
            result["wall_s"],
            result["peak_bytes"],
            run_dir / RESULT,
        )
    return result


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    import lowmem.trainer  # noqa: F401  (imported by run: frozen with the rest below)
    from lowmem.profiler.peak import freeze_imports

    freeze_imports()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    single = HydraConfig.get().mode == RunMode.RUN
    if single:
        distributed.record_run_directory(run_dir)
    run(cfg, run_dir)
    if single:  # (a sweep's jobs share one process group)
        distributed.leave()


def quiet_hydra_on_other_ranks() -> None:
    """Under torchrun only rank 0 owns the run directory: the other ranks write no Hydra files
    and no log file (their timestamped run directory could even differ by a second)."""
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv = [a for a in sys.argv if not a.startswith("hydra.run.dir=")]
        sys.argv += [
            "hydra.output_subdir=null",
            "hydra/job_logging=disabled",
            "hydra/hydra_logging=disabled",
            "hydra.run.dir=.",
        ]


def continue_in_first_run_directory() -> None:
    """Under ``torchrun --max-restarts``: a restarted rank 0 runs in the directory the job ran in
    before (the default one is named by the start time), where it continues from the last
    checkpoint as the same command run again by hand does."""
    if distributed.restart_count() == 0 or int(os.environ.get("RANK", "0")) != 0:
        return
    if any(a in ("-m", "--multirun") or a.startswith("hydra.mode=") for a in sys.argv[1:]):
        return  # (a sweep's hydra.sweep.dir is not carried across restarts: give one on the command line)
    try:
        first = distributed.first_run_directory()
    except ConfigError as error:
        if any(a.startswith("hydra.run.dir=") for a in sys.argv):
            return
        exit_refused(str(error))
    if first is not None:
        sys.argv = [a for a in sys.argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={first}"]


if __name__ == "__main__":
    refuse_unknown_knobs()
    continue_in_first_run_directory()
    quiet_hydra_on_other_ranks()
    try:
        sys.exit(main())
    finally:  # after the error line, if any (printed by rank 0, which needs the group to know it)
        distributed.abandon()
