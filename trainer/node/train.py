"""`trainer train`: one training worker, alone or under torchrun / deepspeed / accelerate launch.

Order matters. `_run`, on every rank before the process group starts: the config, this node (GPUs,
optimizer), the job (trainer.node.job: the built-in GPT or a Hugging Face fine-tune) with its data
prepared, and whether the model can fit in memory; a bad value fails fast and identically everywhere
(rank 0 says why) instead of one rank hanging. Then `train`, as phases:

1. discover: this rank's place in the job (trainer.node.distributed);
2. resume check, still before anything is written: the checkpoint to resume from is checked against
   this run (trusted files, settings, data and vocabulary);
3. start: the process group; rank 0 takes output_dir's job lock (trainer.joblock: a second job on the
   same output dir is refused, exit 2, every rank together) and removes what an interrupted write of
   the trainer left; a resumed run that has no room for its next checkpoint stops (exit NO_SPACE);
4. build: the job's model in its engine, the batches, run.json;
5. loop (trainer.node.loop), then the job's final save;
6. teardown in `finally`: every rank leaves together where it can, the lock released last.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import traceback
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import exitcodes
from trainer.joblock import LOCK_FILE, JobLock, Locked, job_from_env
from trainer.node import distributed, exit_record, save_request, speedups
from trainer.node.accelerators import AcceleratorMismatch, check_visible_gpus
from trainer.node.checkpoint import (
    CheckpointWriter,
    DiskFull,
    check_resumable,
    checkpoints_dir,
    find_resume_point,
    free_bytes,
    human_size,
    read_state,
    remove_leftovers,
    resume_fingerprint,
    says_no_space,
    space_problem,
)
from trainer.node.config import ConfigError, TrainerConfig, dump_config, format_config_keys, load_config
from trainer.node.data import DataError, required_repeats
from trainer.node.distributed import world_size_from_env
from trainer.node.engines import create_engine
from trainer.node.engines.ds_json import load_user_config, merge_user_config
from trainer.node.health import start_monitor
from trainer.node.hf.evaluation import eval_loss
from trainer.node.job import Job, prepare_job
from trainer.node.loop import Trainer
from trainer.node.memory import MEMORY_FIXES, check_fits, is_out_of_memory, out_of_memory_error
from trainer.node.metrics import RUN_FILE, Reporter
from trainer.node.optim import check_optimizer
from trainer.node.progress import Progress
from trainer.peer_loss import is_peer_loss

if TYPE_CHECKING:
    from trainer.node.distributed import Topology
    from trainer.node.engines import Engine
    from trainer.node.health.monitor import HealthMonitor
    from trainer.node.loop import StepHook, StepResult

EXAMPLES = (
    "trainer train --dry-run --set train.max_steps=200  # check the config and data sizing, train nothing",
    "torchrun --nproc-per-node 2 -m trainer train --config trainer/node/configs/finetune-lora.yaml",
    "trainer train --help-config  # every config key with its type, default and meaning",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config_file",
        nargs="?",
        metavar="CONFIG",
        help="YAML config, as with --config (default: the embedded configs/default.yaml)",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML config (default: the embedded configs/default.yaml)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.max_steps=200 (repeatable; values are YAML)",
    )
    # The `deepspeed` launcher appends --local_rank=N; the rank comes from the environment (LOCAL_RANK).
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the config and the dataset sizing for this world size, print the resolved config, "
        "train nothing",
    )
    parser.add_argument(
        "--show-sample",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="with --dry-run and a Hugging Face model: print training sample N rendered with the chat "
        "template, each run of tokens marked [context] (no loss) or [trained] (repeatable; trainer data)",
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="list every config key with its type, default and meaning (and the Hugging Face Trainer "
        "names they replace), then exit",
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say(message: str, *, consequence: bool = False) -> None:
    """This rank's one-line reason for failing: printed, and kept for its exit record."""
    exit_record.note(message, consequence=consequence)
    print(f"trainer: {message}", file=sys.stderr, flush=True)


def _error(message: str) -> None:
    exit_record.note(message)
    # Every rank finds the same problem; one copy of the message is enough.
    if _rank() == 0:
        print(f"trainer: {message}", file=sys.stderr, flush=True)


#: Everything a run writes (checkpoints, metrics, logs, the final model) is the training account's and
#: its group's to read, nobody else's: the shared dir is reachable by every local account on every node.
RUN_UMASK = 0o027


def run(args: argparse.Namespace) -> int:
    # Narrow, never widen: a stricter umask the user chose (077) stays. Restored on return, for a
    # caller that runs the command in its own process (the tests do).
    previous = os.umask(RUN_UMASK)
    os.umask(previous | RUN_UMASK)
    code = exitcodes.FAILURE
    try:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # Under torchrun: an exception that ends this rank is written, with its traceback, to the
            # error file torchrun names (under its --log-dir); `trainer launch` names the root-cause
            # rank from it. Imported only then: it loads torch.
            from torch.distributed.elastic.multiprocessing.errors import record

            code = record(_run)(args)
        else:
            code = _run(args)
        return code
    except BaseException as error:
        exit_record.note(_last_line(error))
        raise
    finally:
        # This rank's own code and reason (torchrun's exit code is 1 whatever they were).
        exit_record.write(code)
        os.umask(previous)


def record_error(error: BaseException) -> None:
    """Under torchrun, `error` with its traceback in the error file torchrun names for this rank (what
    `@record` writes for an exception that leaves the entry point): `trainer launch` names the
    root-cause rank, its exception and last frame from it. Call it inside the `except` block."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(error)


def _run(args: argparse.Namespace) -> int:
    """Everything a rank can check alone (the config, this node, the data, the memory), then `train`."""
    if args.help_config:
        print(format_config_keys())
        return exitcodes.OK
    try:
        config, world_size, optimizer_note = _load_config(args)
        speedups_note = speedups.describe()  # an unknown name in TRAINER_SPEEDUPS_OFF: a config error
        job = prepare_job(config, world_size, dry_run=args.dry_run)
        if not args.dry_run:  # a dry run may be made elsewhere than on the node
            _check_memory(config, job, world_size)
        repeats, note = required_repeats(
            job.num_samples,
            config.data,
            config.train.micro_batch_size,
            world_size,
            config.train.gradient_accumulation_steps,
        )
        if args.dry_run:
            print(dump_config(config), end="")
        # With train.num_epochs the steps follow from the prepared data: known only now.
        steps_note = config.train.derive_max_steps(
            rows=job.num_samples, repeats=repeats, world_size=world_size
        )
        if args.dry_run:
            for line in [*job.notes, *([steps_note] if steps_note else [])]:
                print(f"# {line}")
            print(
                f"# world size {world_size}: {job.num_samples} samples × {repeats} repeats; "
                f"{note or 'the dataset fills the effective batch'}"
            )
            for index in args.show_sample:
                from trainer.node.hf.training_data import show_job_sample

                print(show_job_sample(job, index))
            return exitcodes.OK
    except ConfigError as err:
        _error(f"config error: {err}")
        return exitcodes.CONFIG_ERROR
    except AcceleratorMismatch as err:
        # Each node finds its own problem: its first process says it (rank 0 may be on a good node).
        exit_record.note(str(err))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"trainer: {err}", file=sys.stderr, flush=True)
        return exitcodes.CONFIG_ERROR
    except DataError as err:
        _error(f"data error: {err}")
        return exitcodes.DATA_ERROR
    try:
        notes = [*job.notes, *(line for line in (note, steps_note, optimizer_note, speedups_note) if line)]
        return train(config, job, repeats=repeats, notes=notes)
    except ConfigError as err:  # checkpoint.resume naming a bad path is found once the run starts
        _error(f"config error: {err}")
        return exitcodes.CONFIG_ERROR
    except DiskFull as err:  # no room for the next checkpoint, found before training resumes
        _error(str(err))
        return exitcodes.NO_SPACE
    except KeyboardInterrupt:
        return 130


def _load_config(args: argparse.Namespace) -> tuple[TrainerConfig, int, str | None]:
    """The config, with what only this node can check (webhook, trackers, the user's DeepSpeed JSON, the
    GPUs, the optimizer); the world size; the optimizer's log line (or None)."""
    config = load_config(config_path(args), args.overrides)
    config.health.webhook_target()  # a webhook file or variable is the node's: checked here
    if _rank() == 0:  # rank 0 writes the trackers: their packages must be there, checked here
        config.metrics.check_installed()
    world_size = world_size_from_env()
    if config.distributed.deepspeed_config:  # the user's DeepSpeed JSON: refused here, on every rank
        merge_user_config(
            load_user_config(config.distributed.deepspeed_config),
            config.distributed.deepspeed_config,
            train=config.train,
            distributed=config.distributed,
            world_size=world_size,
            bf16=None,
        )
    optimizer_note = None
    if not args.dry_run:
        check_visible_gpus()
        optimizer_note = check_optimizer(config.train, device_type=_device_type())
    return config, world_size, optimizer_note


def config_path(args: argparse.Namespace) -> str | None:
    """The config file named as CONFIG or --config (ConfigError when both name different files)."""
    if args.config_file and args.config and args.config_file != args.config:
        raise ConfigError(
            "--config",
            f"two config files given ({args.config_file} and --config {args.config}); give one",
        )
    return args.config_file or args.config


def _device_type() -> str:
    """What this rank will train on: the engine's choice (trainer.node.distributed), known early."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_memory(config: TrainerConfig, job: Job, world_size: int) -> None:
    """ConfigError("model") if the model's weights, gradients and optimizer state alone cannot fit in
    this node's memory (trainer.node.memory.check_fits): before the process group or any file."""
    section = config.distributed
    if section.deepspeed_config:
        zero = load_user_config(section.deepspeed_config).get("zero_optimization", {})
        offload = [zero.get(name) for name in ("offload_optimizer", "offload_param")]
        if any(isinstance(o, dict) and o.get("device", "none") != "none" for o in offload):
            return  # where offloaded state lives (CPU, NVMe) is the user's plan: not second-guessed
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if _device_type() == "cuda" else "cpu"
    parameters, trained, weight_bytes = job.footprint(on_gpu=device.startswith("cuda"))
    check_fits(
        parameters=parameters,
        trained=trained,
        weight_bytes=weight_bytes,
        engine=section.engine,
        zero_stage=section.zero_stage,
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
    )


def train(
    config: TrainerConfig, job: Job, *, repeats: int, notes: list[str], hooks: list[StepHook] | None = None
) -> int:
    """discover → resume check → start → build → loop; teardown in `finally`, every rank together.

    job: what is trained (trainer.node.job: the built-in GPT, or a Hugging Face fine-tune when
    model.name_or_path is set), prepared by `_run`."""
    # SIGUSR2 saves and stops (a scheduler's warning before the job's end), from here on.
    save_request.install()
    topology = distributed.discover(config.distributed.backend)
    output_dir = Path(config.output_dir)
    reporter = Reporter(
        output_dir,
        enabled=topology.is_main,
        max_steps=config.train.max_steps,
        metrics=config.metrics,
        hparams=config.to_dict(),
    )
    resume_from, resume_notes = _resume_point(config, job, topology.world_size)
    job_lock = _start(config, topology, reporter, resume_from)
    clean = False
    on_gpu = topology.device.startswith("cuda")
    health = start_monitor(
        config.health,
        rank=topology.rank,
        local_rank=topology.local_rank,
        cuda_device=topology.local_rank if on_gpu else None,
        host=topology.hostname,
        say=reporter.info,
    )
    # The step each rank is in, for the launcher's stall watchdog (nothing outside `trainer launch`).
    progress = Progress.from_env(topology.rank, topology.local_rank, topology.device)
    trainer = None
    try:
        for line in [*notes, *resume_notes]:
            if line:
                reporter.info(line)
        trainer = _build(
            config,
            job,
            topology,
            reporter,
            repeats=repeats,
            resume_from=resume_from,
            hooks=(*(hooks or ()), save_request.hook, *health.step_hooks(on_gpu=on_gpu)),
            on_step_start=progress.started,
            on_step_end=progress.step_done,
            announce=progress.announced,
        )
        code = trainer.train()
        _note_gpu_fault(code, health)
        _note_requested_stop(code, trainer.stopped_at)
        if code == exitcodes.OK:
            final = job.save_final(
                trainer.engine, output_dir, is_main=topology.is_main, trained=bool(trainer.steps_this_run)
            )
            if final is not None:
                reporter.info(f"final model: {final}")
        if code != exitcodes.STOPPED_AT_CHECKPOINT:  # the job ends soon: the resumed run draws them
            reporter.write_report()  # rank 0's PNG curves; a failure to draw is a warning, never the run's
        clean = True  # every rank got here with the same code: leaving together is safe
        return code
    except Exception as error:
        code, clean = _failure(error, topology, output_dir, health)
        return code
    finally:
        progress.close()
        health.stop()
        # Free the model first: DDP's reducer holds the gloo process group, and when the reducer was
        # the group's last holder (after destroy_process_group) its destructor joined gloo's worker
        # thread while holding the GIL that thread waited for: a finished rank hung at exit (seen
        # with gdb, 2 of 12 runs on a loaded machine) until the launcher's stall timeout.
        trainer = None
        gc.collect()
        distributed.shutdown(clean)
        if job_lock is not None:  # after the last write of every rank (a clean shutdown waits for them)
            job_lock.release()


def _resume_point(config: TrainerConfig, job: Job, world_size: int) -> tuple[Path | None, list[str | None]]:
    """The checkpoint to resume from (or None), checked against this run before the process group
    starts (ConfigError on every rank); its notes for the log."""
    resume_from, resume_note = find_resume_point(config.checkpoint, Path(config.output_dir))
    warnings = []
    if resume_from is not None:
        # The vocabulary and the data, by content.
        warnings = check_resumable(resume_from, config, world_size=world_size, identity=job.identity)
    return resume_from, [resume_note, *warnings]


def _start(
    config: TrainerConfig, topology: Topology, reporter: Reporter, resume_from: Path | None
) -> JobLock | None:
    """The process group, output_dir's job lock (rank 0 holds it: returned), the leftovers of an
    interrupted write removed, output_dir seen by every rank, room for a resumed run's next checkpoint.
    A refusal (ConfigError, DiskFull) is every rank's: they leave together, the lock released."""
    output_dir = Path(config.output_dir)
    distributed.start(topology, config.distributed.timeout_s)
    # One job per output dir: a second job's start would delete this one's checkpoint in flight.
    job_lock = JobLock(output_dir, job=job_from_env()) if topology.is_main else None
    try:
        _take_job_lock(job_lock, reporter.info)
        if topology.is_main:
            # Before anything is written: an interrupted write (a kill, a full disk) may hold the
            # space this run's first write needs.
            remove_leftovers(output_dir, reporter.info)
        _check_output_dir_is_shared(output_dir, topology)
        if resume_from is not None:
            _check_room_to_resume(config, topology, resume_from)
    except (ConfigError, DiskFull):
        distributed.shutdown(clean=True)  # every rank found the same problem: they leave together
        if job_lock is not None:
            job_lock.release()
        raise
    return job_lock


def _check_room_to_resume(config: TrainerConfig, topology: Topology, resume_from: Path) -> None:
    """DiskFull on every rank if a resumed run that still has steps to train has no room for its next
    checkpoint: it is as big as the one resumed, and without room for it, training is lost work."""
    resumed = int(read_state(resume_from).get("step", 0))
    if resumed >= config.train.max_steps:
        return
    save_steps = config.checkpoint.save_steps
    next_save = resumed + save_steps - resumed % save_steps if save_steps else 0
    next_save = min(next_save or config.train.max_steps, config.train.max_steps)
    problem = distributed.gather(
        space_problem(
            checkpoints_dir(config.output_dir),
            step=next_save,
            save_total_limit=config.checkpoint.save_total_limit,
        )
        if topology.is_main
        else None
    )[0]
    if problem:
        raise DiskFull(problem, everywhere=True)


def _build(
    config: TrainerConfig,
    job: Job,
    topology: Topology,
    reporter: Reporter,
    *,
    repeats: int,
    resume_from: Path | None,
    hooks: tuple[StepHook, ...],
    on_step_start: Callable[[int], None],
    on_step_end: Callable[[StepResult], None],
    announce: Callable[[str], AbstractContextManager[None]] | None = None,
) -> Trainer:
    """The model in its engine, the batches, run.json and the first log lines; the loop that trains."""
    on_gpu = topology.device.startswith("cuda")
    # bf16 weights need DeepSpeed's bf16 mode (it keeps fp32 master copies of them).
    bf16 = _mixed_precision_bf16(config) or job.bf16_weights(on_gpu)
    # Same seed everywhere for the initial weights; then a per-rank offset so dropout differs.
    seed = config.train.seed
    _seed(seed)
    engine, model_line = _build_engine(config, job, topology, bf16=bf16)
    _seed(seed + topology.rank)
    note = job.after_engine(engine)
    if note:
        reporter.info(note)
    batches = job.batches(topology, repeats=repeats)
    evaluate = _evaluator(engine, job.eval_batches(topology), topology.device)
    _write_run_file(config, job, topology, reporter, bf16=bf16, repeats=repeats)
    reporter.info(
        f"training {model_line} with "
        f"{config.distributed.engine} on {topology.world_size} process(es), "
        f"{topology.num_nodes} node(s), {topology.device}"
        f"{', bf16' if bf16 else ''}; output in {Path(config.output_dir)}"
    )
    if topology.is_main and os.environ.get("TRAINER_PRINT_CONFIG"):
        print(dump_config(config), end="")
    checkpoints = CheckpointWriter(
        config.checkpoint,
        config.output_dir,
        rank=topology.rank,
        barrier=distributed.barrier,
        log=reporter.info,
        share=lambda value: distributed.gather(value)[0],
    )
    return Trainer(
        train_config=config.train,
        save_steps=config.checkpoint.save_steps,
        fingerprint=resume_fingerprint(config, job.identity),
        topology=topology,
        engine=engine,
        batches=batches,
        checkpoints=checkpoints,
        reporter=reporter,
        resume_from=resume_from,
        hooks=hooks,
        evaluate=evaluate,
        eval_every=config.eval.every_steps,
        on_step_start=on_step_start,
        on_step_end=on_step_end,
        announce=announce,
    )


def _mixed_precision_bf16(config: TrainerConfig) -> bool:
    import torch

    return config.train.mixed_precision == "bf16" or (
        config.train.mixed_precision == "auto"
        and torch.cuda.is_available()
        and torch.cuda.is_bf16_supported()
    )


def _seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build_engine(config: TrainerConfig, job: Job, topology: Topology, *, bf16: bool) -> tuple[Engine, str]:
    """The job's model (compiled if asked) in the configured engine, and the log's line for it. Running
    out of memory here is the config's problem, said as such."""
    try:
        model, model_line = job.build_model(topology, bf16=bf16)
        if compile_wanted(config, topology):
            model.compile()
            model_line += ", compiled"
        engine = create_engine(
            config.train, config.distributed, Path(config.output_dir), topology, model, bf16=bf16
        )
    except Exception as error:  # the estimate before the start is a lower bound: the real thing
        if is_out_of_memory(error):
            raise out_of_memory_error(error) from None
        raise
    return engine, model_line


def compile_wanted(config: TrainerConfig, topology: Topology) -> bool:
    """train.compile resolved: auto compiles where it was measured to help (docs/performance.md)."""
    if config.train.compile != "auto":
        return bool(config.train.compile)
    # Not measured compiled: ZeRO-3 (it gathers each layer's weights in hooks around its forward) and
    # gradient checkpointing (each layer's forward run again in the backward).
    zero3 = config.distributed.engine == "deepspeed" and config.distributed.zero_stage == 3
    unmeasured = zero3 or config.train.gradient_checkpointing
    return topology.device.startswith("cuda") and bool(config.model.name_or_path) and not unmeasured


def _evaluator(engine: Engine, eval_batches: Any, device: str) -> Callable[[], float] | None:
    """The eval loss over eval_batches (every rank calls it together), or None without eval data."""
    if eval_batches is None:
        return None

    def evaluate() -> float:
        return eval_loss(engine, eval_batches, device)

    return evaluate


def _write_run_file(
    config: TrainerConfig, job: Job, topology: Topology, reporter: Reporter, *, bf16: bool, repeats: int
) -> None:
    """run.json (rank 0): the config, where every rank runs, the steps and the data. A collective."""
    hosts = distributed.gather(topology.to_dict())
    reporter.write_json(
        RUN_FILE,
        {
            "config": config.to_dict(),
            "topology": {
                "world_size": topology.world_size,
                "num_nodes": topology.num_nodes,
                "engine": config.distributed.engine,
                "backend": topology.backend,
                "device": topology.device,
                "bf16": bf16,
                "ranks": hosts,
            },
            "steps": config.train.steps_record(
                rows=job.num_samples, repeats=repeats, world_size=topology.world_size
            ),
            "data": {
                **job.facts,
                "repeats": repeats,
                "effective_batch": config.train.micro_batch_size
                * topology.world_size
                * config.train.gradient_accumulation_steps,
            },
        },
    )


def _note_gpu_fault(code: int, health: HealthMonitor) -> None:
    """The exit record's reason when the health check stopped the run."""
    if code != exitcodes.GPU_FAULT:  # the breaker's per-step check stopped every rank together
        return
    if (fault := health.fault) is not None:
        exit_record.note(
            f"GPU fault: GPU {fault.gpu} (uuid {fault.uuid}) of rank {fault.rank} tripped the health "
            f"check, {fault.metric}={fault.value}"
        )
    else:
        exit_record.note("stopped because another rank's GPU tripped the health check", consequence=True)


def _note_requested_stop(code: int, step: int) -> None:
    """The exit record's reason when the run saved and stopped on request (not a failure: the launcher
    reads the code and resumes, or requeues a Slurm job)."""
    if code != exitcodes.STOPPED_AT_CHECKPOINT:
        return
    how = "as SIGUSR2 asked" if save_request.requested() else "as another rank's SIGUSR2 asked"
    exit_record.note(f"stopped at step {step} after its checkpoint, {how}")


def _failure(
    error: Exception, topology: Topology, output_dir: Path, health: HealthMonitor
) -> tuple[int, bool]:
    """The exit code for an error of the run, said once (by rank 0 where every rank has it), and whether
    every rank has it (they may then leave together)."""
    # A CUDA error in the step, or any error after this rank's GPU faulted: exit 75, not 1.
    if (code := health.exit_code_for(error, on_gpu=topology.device.startswith("cuda"))) is not None:
        exit_record.note(f"GPU fault: {_last_line(error)}")
        return code, False
    if isinstance(error, ConfigError):  # found at load or build: a checkpoint or a model that does not fit
        exit_record.note(f"config error: {error}")
        if topology.is_main or error.key == "model":  # memory runs out on one rank, not on all
            print(f"trainer: config error: {error}", file=sys.stderr, flush=True)
        return exitcodes.CONFIG_ERROR, False
    if isinstance(error, DiskFull):
        exit_record.note(str(error))
        if topology.is_main or not error.everywhere:
            print(f"trainer: {error}", file=sys.stderr, flush=True)
        return exitcodes.NO_SPACE, error.everywhere
    if says_no_space(error):  # run.json, metrics.jsonl, ds_config.json, the final model
        _say(
            f"rank {topology.rank}: no space left on device in {output_dir} "
            f"({_failed_file(error)}): {human_size(free_bytes(output_dir))} free; the checkpoints "
            "written so far are intact; free space there, then run the same command again to resume"
        )
        return exitcodes.NO_SPACE, False
    if is_out_of_memory(error):  # the estimate at start leaves activations out: the step found them
        _say(
            f"rank {topology.rank}: config error: model: training ran out of memory "
            f"({_last_line(error)}); use a smaller train.micro_batch_size (more "
            f"train.gradient_accumulation_steps keep the effective batch), "
            f"train.gradient_checkpointing=true (Hugging Face models), or {MEMORY_FIXES}"
        )
        return exitcodes.CONFIG_ERROR, False
    if isinstance(error, RuntimeError) and is_peer_loss(str(error)):
        # A consequence (another rank died first, or its node vanished), not a cause: one line, no
        # traceback; the launcher orders the ranks' exit records to name the first cause.
        first = str(error).strip().splitlines()[0][:300]
        _say(f"rank {topology.rank} stopped: another rank failed first ({first})", consequence=True)
        return exitcodes.FAILURE, False
    exit_record.note(_last_line(error))
    print(f"trainer: rank {topology.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    record_error(error)
    return exitcodes.FAILURE, False


def _last_line(error: BaseException) -> str:
    """The error's type and first sentences, up to about 200 characters (CUDA's OOM runs to 600)."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    text = lines[0]
    if len(text) > 200:
        cut = text.rfind(". ", 0, 200)
        text = text[: cut + 1] if cut > 0 else text[:200]
    return f"{type(error).__name__}: {text}"


def _failed_file(error: BaseException) -> str:
    """The file an OSError names (in the exception or what caused it), or the error's type."""
    cause: BaseException | None = error
    for _ in range(8):
        if cause is None:
            break
        if isinstance(cause, OSError) and cause.filename:
            return f"writing {cause.filename}"
        cause = cause.__cause__ or cause.__context__
    return type(error).__name__


def _take_job_lock(lock, say) -> None:
    """Rank 0 takes output_dir's job lock (trainer.joblock; `lock` is None on the other ranks) and every
    rank gets its verdict: a refusal is a ConfigError on all of them (a full disk: DiskFull), so the
    job leaves together before anything in output_dir is removed or written. A collective: every
    rank calls it."""
    problem = None
    if lock is not None:
        try:
            try:
                note = lock.acquire()
            except OSError as err:
                if not says_no_space(err) or lock.held_by_live_job():
                    raise
                # A full disk and no live job on the output dir: an incomplete write of a stopped run
                # (killed, its lock left stale) may be what fills it, and only its removal makes room
                # for the lock: safe now, since every job holds the lock while it writes.
                remove_leftovers(lock.directory, say)
                note = lock.acquire()
            if note:
                say(note)
            lock.start_heartbeat()
        except Locked as err:
            problem = ("locked", str(err))
        except OSError as err:
            if says_no_space(err):
                problem = (
                    "full",
                    f"no space left on device in {lock.directory} for its job lock ({LOCK_FILE}): free "
                    "space there (other files, or use another output_dir), then run the same command "
                    "again to resume",
                )
            else:
                problem = ("locked", f"cannot take the job lock in {lock.directory}: {err.strerror or err}")
    problem = distributed.gather(problem)[0]
    if problem:
        kind, text = problem
        if kind == "full":
            raise DiskFull(text, everywhere=True)
        raise ConfigError("output_dir", text)


def _check_output_dir_is_shared(output_dir, topology) -> None:
    """Every rank must see what rank 0 writes in output_dir: checkpoints are written by all ranks into
    a directory rank 0 creates, and resume reads `latest` on every node. A node-local path on a
    multi-node run fails here, at once, with the fix, instead of at the first checkpoint."""
    token = distributed.gather(uuid.uuid4().hex if topology.is_main else None)[0]
    marker = output_dir / f".shared-check-{token}"
    if topology.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
    distributed.barrier()
    sees = distributed.gather((marker.exists(), topology.hostname))
    distributed.barrier()
    if topology.is_main:
        marker.unlink()
    blind = [f"rank {rank} on {host}" for rank, (seen, host) in enumerate(sees) if not seen]
    if blind:
        raise ConfigError(
            "output_dir",
            f"{', '.join(blind)} cannot see the files rank 0 writes in {output_dir}: put output_dir on a "
            "file system shared by all nodes, mounted at the same path (the cluster's shared directory)",
        )
