"""`trainer train`: one training worker, alone or under torchrun / deepspeed / accelerate launch.

Order matters: the config, the data and whether the model can fit in memory are checked on every
rank before the process group starts, so a bad value fails fast and identically everywhere (rank 0
says why) instead of one rank hanging. Then, still before anything is written: the checkpoint to
resume from is checked against this run (trusted files, settings, data and vocabulary); with the
process group up, rank 0 takes output_dir's job lock (trainer.joblock: a second job on the same
output dir is refused, exit 2, every rank together) and removes what an interrupted write of the
trainer left, and a resumed run that has no room for its next checkpoint stops (exit NO_SPACE).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from typing import TYPE_CHECKING

from trainer import exitcodes
from trainer.node import exit_record
from trainer.peer_loss import is_peer_loss

if TYPE_CHECKING:
    from trainer.node.config import TrainerConfig
    from trainer.node.loop import StepHook

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
    from trainer.node.accelerators import AcceleratorMismatch, check_visible_gpus
    from trainer.node.checkpoint import DiskFull
    from trainer.node.config import ConfigError, dump_config, load_config
    from trainer.node.data import DataError, count_samples, read_text, required_repeats
    from trainer.node.distributed import world_size_from_env

    if args.help_config:
        from trainer.node.config import format_config_keys

        print(format_config_keys())
        return exitcodes.OK
    try:
        config = load_config(config_path(args), args.overrides)
        config.health.webhook_target()  # a webhook file or variable is the node's: checked here
        if _rank() == 0:  # rank 0 writes the trackers: their packages must be there, checked here
            config.metrics.check_installed()
        world_size = world_size_from_env()
        if config.distributed.deepspeed_config:  # the user's DeepSpeed JSON: refused here, on every rank
            from trainer.node.engines.ds_json import load_user_config, merge_user_config

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
            from trainer.node.optim import check_optimizer

            optimizer_note = check_optimizer(config.train, device_type=_device_type())
        corpus = None
        if config.model.name_or_path:
            # The model directory, tokenizer, LoRA targets and every record are checked here, on every
            # rank, before the process group: bad input stops all ranks at once with the same message.
            from trainer.node.hf.job import FineTune

            corpus = FineTune.prepare(config, world_size, keep_data=not args.dry_run)
            samples = corpus.num_samples
        elif args.dry_run:
            samples = count_samples(len(read_text(config.data.path)), config.data.block_size)
        else:
            from trainer.node.data import load_corpus

            corpus = load_corpus(config.data)
            samples = corpus.num_samples
        if not args.dry_run:  # a dry run may be made elsewhere than on the node
            _check_memory(config, corpus, world_size)
        repeats, note = required_repeats(
            samples,
            config.data,
            config.train.micro_batch_size,
            world_size,
            config.train.gradient_accumulation_steps,
        )
        if args.dry_run:
            print(dump_config(config), end="")
        # With train.num_epochs the steps follow from the prepared data: known only now.
        steps_note = config.train.derive_max_steps(rows=samples, repeats=repeats, world_size=world_size)
        if args.dry_run:
            for line in [*getattr(corpus, "notes", []), *([steps_note] if steps_note else [])]:
                print(f"# {line}")
            print(
                f"# world size {world_size}: {samples} samples × {repeats} repeats; "
                f"{note or 'the dataset fills the effective batch'}"
            )
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
        notes = [
            *getattr(corpus, "notes", []),
            *(line for line in (note, steps_note, optimizer_note) if line),
        ]
        return train(config, corpus, repeats=repeats, notes=notes)
    except ConfigError as err:  # checkpoint.resume naming a bad path is found once the run starts
        _error(f"config error: {err}")
        return exitcodes.CONFIG_ERROR
    except DiskFull as err:  # no room for the next checkpoint, found before training resumes
        _error(str(err))
        return exitcodes.NO_SPACE
    except KeyboardInterrupt:
        return 130


def config_path(args: argparse.Namespace) -> str | None:
    """The config file named as CONFIG or --config (ConfigError when both name different files)."""
    from trainer.configerror import ConfigError

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


def _check_memory(config: TrainerConfig, corpus, world_size: int) -> None:
    """ConfigError("model") if the model's weights, gradients and optimizer state alone cannot fit in
    this node's memory (trainer.node.model.check_fits): before the process group or any file."""
    import torch

    from trainer.node.model import check_fits, parameter_count

    distributed = config.distributed
    if distributed.deepspeed_config:
        from trainer.node.engines.ds_json import load_user_config

        zero = load_user_config(distributed.deepspeed_config).get("zero_optimization", {})
        offload = [zero.get(name) for name in ("offload_optimizer", "offload_param")]
        if any(isinstance(o, dict) and o.get("device", "none") != "none" for o in offload):
            return  # where offloaded state lives (CPU, NVMe) is the user's plan: not second-guessed
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if config.model.name_or_path:
        parameters, trained = corpus.parameter_counts()
        weight_bytes = 0.5 if config.lora.qlora else corpus.weights_dtype(device.startswith("cuda")).itemsize
    else:
        parameters = parameter_count(
            config.model, vocab_size=len(corpus.vocab), block_size=config.data.block_size
        )
        trained, weight_bytes = parameters, 4
    check_fits(
        parameters=parameters,
        trained=trained,
        weight_bytes=weight_bytes,
        engine=distributed.engine,
        zero_stage=distributed.zero_stage,
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
    )


def train(
    config: TrainerConfig, corpus, *, repeats: int, notes: list[str], hooks: list[StepHook] | None = None
) -> int:
    """Start the process group, build model and engine, resume, run the loop, leave cleanly.

    corpus: the built-in GPT's text (trainer.node.data.Corpus), or a Hugging Face fine-tuning job
    (trainer.node.hf.job.FineTune) when model.name_or_path is set."""
    import random
    from pathlib import Path

    import numpy as np
    import torch

    from trainer.joblock import JobLock, job_from_env
    from trainer.node import distributed
    from trainer.node.checkpoint import (
        CheckpointWriter,
        DiskFull,
        check_resumable,
        find_resume_point,
        free_bytes,
        human_size,
        read_state,
        remove_leftovers,
        resume_fingerprint,
        says_no_space,
        space_problem,
    )
    from trainer.node.config import ConfigError, dump_config
    from trainer.node.data import ShardedBatches
    from trainer.node.engines import create_engine
    from trainer.node.health import start_monitor
    from trainer.node.loop import Trainer
    from trainer.node.metrics import RUN_FILE, Reporter
    from trainer.node.model import GPT, MEMORY_FIXES, is_out_of_memory, out_of_memory_error
    from trainer.node.progress import Progress

    topology = distributed.discover(config.distributed.backend)
    output_dir = Path(config.output_dir)
    reporter = Reporter(
        output_dir,
        enabled=topology.is_main,
        max_steps=config.train.max_steps,
        metrics=config.metrics,
        hparams=config.to_dict(),
    )
    resume_from, resume_note = find_resume_point(config.checkpoint, output_dir)
    identity = corpus.identity  # the vocabulary and the data, by content
    resume_warnings = []
    if resume_from is not None:
        resume_warnings = check_resumable(
            resume_from, config, world_size=topology.world_size, identity=identity
        )
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
            resumed = int(read_state(resume_from).get("step", 0))
            if resumed < config.train.max_steps:
                # The next checkpoint is as big as this one: without room for it, training is lost work.
                save_steps = config.checkpoint.save_steps
                next_save = resumed + save_steps - resumed % save_steps if save_steps else 0
                next_save = min(next_save or config.train.max_steps, config.train.max_steps)
                problem = distributed.gather(
                    space_problem(
                        output_dir / "checkpoints",
                        step=next_save,
                        save_total_limit=config.checkpoint.save_total_limit,
                    )
                    if topology.is_main
                    else None
                )[0]
                if problem:
                    raise DiskFull(problem, everywhere=True)
    except (ConfigError, DiskFull):
        distributed.shutdown(clean=True)  # every rank found the same problem: they leave together
        if job_lock is not None:
            job_lock.release()
        raise
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
    progress = Progress.from_env(topology.rank, topology.local_rank)
    try:
        for note in [*notes, resume_note, *resume_warnings]:
            if note:
                reporter.info(note)
        bf16 = config.train.mixed_precision == "bf16" or (
            config.train.mixed_precision == "auto"
            and torch.cuda.is_available()
            and torch.cuda.is_bf16_supported()
        )
        finetune = corpus if config.model.name_or_path else None
        if finetune is not None:
            # bf16 weights need DeepSpeed's bf16 mode (it keeps fp32 master copies of them).
            bf16 = bf16 or finetune.weights_dtype(on_gpu) == torch.bfloat16
        # Same seed everywhere for the initial weights; then a per-rank offset so dropout differs.
        seed = config.train.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            if finetune is not None:
                model, model_line = finetune.build_model(topology, bf16=bf16)
            else:
                model = GPT(config.model, vocab_size=len(corpus.vocab), block_size=config.data.block_size)
                parameter_count = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions
                model_line = f"{parameter_count:,} parameters"
            if config.train.compile:
                model.compile()
            engine = create_engine(config.train, config.distributed, output_dir, topology, model, bf16=bf16)
        except Exception as error:  # the estimate before the start is a lower bound: the real thing
            if is_out_of_memory(error):
                raise out_of_memory_error(error) from None
            raise
        random.seed(seed + topology.rank)
        np.random.seed(seed + topology.rank)
        torch.manual_seed(seed + topology.rank)
        evaluate = None
        if finetune is not None:
            packing_note = finetune.check_packing(engine)
            if packing_note:
                reporter.info(packing_note)
            batches = finetune.batches(topology, repeats=repeats)
            eval_batches = finetune.eval_batches(topology)
            if eval_batches is not None:
                from trainer.node.hf.evaluation import eval_loss

                def evaluate() -> float:
                    return eval_loss(engine, eval_batches, topology.device)

            data_facts = finetune.facts
        else:
            batches = ShardedBatches(
                corpus,
                repeats=repeats,
                micro_batch_size=config.train.micro_batch_size,
                rank=topology.rank,
                world_size=topology.world_size,
                seed=seed,
                device=topology.device,
            )
            data_facts = {
                "path": config.data.path or "pydoc_data.topics (bundled)",
                "characters": len(corpus.ids),
                "vocab_size": len(corpus.vocab),
                "samples": corpus.num_samples,
            }
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
                    rows=corpus.num_samples, repeats=repeats, world_size=topology.world_size
                ),
                "data": {
                    **data_facts,
                    "repeats": repeats,
                    "effective_batch": config.train.micro_batch_size
                    * topology.world_size
                    * config.train.gradient_accumulation_steps,
                },
            },
        )
        reporter.info(
            f"training {model_line} with "
            f"{config.distributed.engine} on {topology.world_size} process(es), "
            f"{topology.num_nodes} node(s), {topology.device}"
            f"{', bf16' if bf16 else ''}; output in {output_dir}"
        )
        if topology.is_main and os.environ.get("TRAINER_PRINT_CONFIG"):
            print(dump_config(config), end="")
        checkpoints = CheckpointWriter(
            config.checkpoint,
            output_dir,
            rank=topology.rank,
            barrier=distributed.barrier,
            log=reporter.info,
            share=lambda value: distributed.gather(value)[0],
        )
        trainer = Trainer(
            train_config=config.train,
            save_steps=config.checkpoint.save_steps,
            fingerprint=resume_fingerprint(config, identity),
            topology=topology,
            engine=engine,
            batches=batches,
            checkpoints=checkpoints,
            reporter=reporter,
            resume_from=resume_from,
            hooks=(*(hooks or ()), progress.step_done, *health.step_hooks(on_gpu=on_gpu)),
            evaluate=evaluate,
            eval_every=config.eval.every_steps,
            on_step_start=progress.started,
        )
        code = trainer.train()
        if code == exitcodes.GPU_FAULT:  # the breaker's per-step check stopped every rank together
            if (fault := health.fault) is not None:
                exit_record.note(
                    f"GPU fault: GPU {fault.gpu} (uuid {fault.uuid}) of rank {fault.rank} tripped the health "
                    f"check, {fault.metric}={fault.value}"
                )
            else:
                exit_record.note(
                    "stopped because another rank's GPU tripped the health check", consequence=True
                )
        if finetune is not None and code == exitcodes.OK:
            final = output_dir / "final"
            if trainer.steps_this_run or not final.is_dir():
                reporter.info(
                    f"final model: {finetune.write_final(engine, output_dir, is_main=topology.is_main)}"
                )
        reporter.write_report()  # rank 0's PNG curves; a failure to draw is a warning, never the run's
        clean = True  # every rank got here with the same code: leaving together is safe
        return code
    except Exception as error:
        # A CUDA error in the step, or any error after this rank's GPU faulted: exit 75, not 1.
        if (code := health.exit_code_for(error, on_gpu=on_gpu)) is not None:
            exit_record.note(f"GPU fault: {_last_line(error)}")
            return code
        if isinstance(
            error, ConfigError
        ):  # found at load or build: a checkpoint or a model that does not fit
            exit_record.note(f"config error: {error}")
            if topology.is_main or error.key == "model":  # memory runs out on one rank, not on all
                print(f"trainer: config error: {error}", file=sys.stderr, flush=True)
            return exitcodes.CONFIG_ERROR
        if isinstance(error, DiskFull):
            clean = error.everywhere
            exit_record.note(str(error))
            if topology.is_main or not error.everywhere:
                print(f"trainer: {error}", file=sys.stderr, flush=True)
            return exitcodes.NO_SPACE
        if says_no_space(error):  # run.json, metrics.jsonl, ds_config.json, the final model
            _say(
                f"rank {topology.rank}: no space left on device in {output_dir} "
                f"({_failed_file(error)}): {human_size(free_bytes(output_dir))} free; the checkpoints "
                "written so far are intact; free space there, then run the same command again to resume"
            )
            return exitcodes.NO_SPACE
        if is_out_of_memory(error):  # the estimate at start leaves activations out: the step found them
            _say(
                f"rank {topology.rank}: config error: model: training ran out of memory "
                f"({_last_line(error)}); use a smaller train.micro_batch_size (more "
                f"train.gradient_accumulation_steps keep the effective batch), "
                f"train.gradient_checkpointing=true (Hugging Face models), or {MEMORY_FIXES}"
            )
            return exitcodes.CONFIG_ERROR
        if isinstance(error, RuntimeError) and is_peer_loss(str(error)):
            # A consequence (another rank died first, or its node vanished), not a cause: one line, no
            # traceback; the launcher orders the ranks' exit records to name the first cause.
            first = str(error).strip().splitlines()[0][:300]
            _say(f"rank {topology.rank} stopped: another rank failed first ({first})", consequence=True)
            return exitcodes.FAILURE
        exit_record.note(_last_line(error))
        print(f"trainer: rank {topology.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        record_error(error)
        return exitcodes.FAILURE
    finally:
        progress.close()
        health.stop()
        # Free the model first: DDP's reducer holds the gloo process group, and when the reducer was
        # the group's last holder (after destroy_process_group) its destructor joined gloo's worker
        # thread while holding the GIL that thread waited for: a finished rank hung at exit (seen
        # with gdb, 2 of 12 runs on a loaded machine) until the launcher's stall timeout.
        model = engine = trainer = evaluate = None
        gc.collect()
        distributed.shutdown(clean)
        if job_lock is not None:  # after the last write of every rank (a clean shutdown waits for them)
            job_lock.release()


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
    from trainer.joblock import LOCK_FILE, Locked
    from trainer.node import distributed
    from trainer.node.checkpoint import DiskFull, remove_leftovers, says_no_space
    from trainer.node.config import ConfigError

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
    import uuid

    from trainer.node import distributed
    from trainer.node.config import ConfigError

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
