"""The training loop: resume, then per step train → per-step checks → log → save; then the summary.

The loop gets the sections it needs, not the whole config (`trainer.node.config` imports the
sections' modules, so none of them imports it). Per-step checks (e.g. a GPU health circuit breaker)
are `StepHook`s: each gets the step's result and returns None to continue or an exit code to stop;
`Trainer._after_step` is the one place they run, and all ranks stop together with the same code, which
costs a collective per step. A callback that only watches (progress for the launcher's watchdog) is
`on_step_end` instead: it never stops the run, so it needs no collective.

Nothing in a step waits for the device (trainer.node.speedups: async_loss): the engine's loss stays a
tensor on the device, read on logged and saved steps only, and on a GPU the per-step checks' vote is
all-reduced on the device and read one step later, by which time it is there: a stop comes one step
after the check that asked for it, on every rank at the same step, and before any checkpoint, except
STOPPED_AT_CHECKPOINT (trainer.node.save_request: SIGUSR2, a scheduler's warning before the job's
end), which saves that step first and then stops.

torch is imported inside functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import exitcodes
from trainer.configerror import ConfigError

if TYPE_CHECKING:
    from trainer.node.checkpoint import CheckpointWriter
    from trainer.node.distributed import Topology
    from trainer.node.engines import Engine
    from trainer.node.metrics import Reporter
    from trainer.node.order import Position, StepBatches
    from trainer.node.schedule import TrainConfig


@dataclass(frozen=True)
class StepResult:
    """What a per-step check sees after each optimizer step."""

    step: int
    max_steps: int
    device_loss: Any
    """This rank's mean loss over the step's micro-batches, as the engine returned it (a tensor on the
    device, or a float): `loss` reads it."""
    lr: float
    step_time_s: float
    """The time the loop spent in the step (without waiting for the device under async_loss)."""
    rank: int

    @property
    def loss(self) -> float:
        """This rank's mean loss over the step's micro-batches (on a GPU, reading it waits for the step)."""
        return float(self.device_loss)


#: A per-step check: None to continue, or an exit code (e.g. exitcodes.GPU_FAULT) to stop the run.
StepHook = Callable[[StepResult], "int | None"]


@dataclass
class Trainer:
    train_config: TrainConfig
    save_steps: int
    """Checkpoint every this many steps (0: only at the end)."""
    fingerprint: dict[str, Any]
    """What a checkpoint must share with the config that resumes it (checkpoint.resume_fingerprint)."""
    topology: Topology
    engine: Engine
    batches: StepBatches
    checkpoints: CheckpointWriter
    reporter: Reporter
    resume_from: Path | None = None
    hooks: Sequence[StepHook] = field(default_factory=tuple)
    evaluate: Callable[[], float] | None = None
    """The eval loss (same on every rank; all ranks call it together), or None without eval data."""
    eval_every: int = 0
    """Evaluate every this many steps (0: at the last step only)."""
    on_step_start: Callable[[int], None] | None = None
    """Called with each step's number as this rank starts it (trainer.node.progress)."""
    on_step_end: Callable[[StepResult], None] | None = None
    """Called with each step's result as this rank ends it, before the checks (trainer.node.progress)."""
    announce: Callable[[str], AbstractContextManager[None]] | None = None
    """Wraps a pause between steps (`eval`, `checkpoint`), so the launcher's watchdog gives it a bound of
    its own (trainer.node.progress.Progress.announced)."""
    run_facts: dict[str, Any] = field(default_factory=dict)
    steps_this_run: int = 0
    stopped_at: int = 0
    """The step saved and stopped at on request (STOPPED_AT_CHECKPOINT), 0 otherwise."""

    def train(self) -> int:
        train = self.train_config
        position = self._resume()
        # Where the data continues is the checkpoint's position in the sample order, not the step.
        self.batches.start(position, train.gradient_accumulation_steps)
        start = position.step
        if start >= train.max_steps:
            self.reporter.info(
                f"already trained to step {start} ({self.resume_from}): nothing to do. Raise train.max_steps "
                "to train further, or set checkpoint.resume=never (or another output_dir) to start over"
            )
        self.reporter.start(first_step=start + 1, resumed_step=start)
        interval_start, interval_steps, interval_step_time, interval_tokens = time.perf_counter(), 0, 0.0, 0
        loss = self.run_facts.get("resumed_loss", float("nan"))
        started = time.perf_counter()
        from trainer.node import speedups

        wait_in_step = not speedups.enabled("async_loss")
        vote = _StopVote(self.topology.device, deferred=not wait_in_step)
        try:
            for step in range(start + 1, train.max_steps + 1):
                if self.on_step_start is not None:
                    self.on_step_start(step)
                step_start = time.perf_counter()
                local_loss = self.engine.train_step(self.batches.micro_batches(step))
                if wait_in_step:
                    local_loss = float(local_loss)
                step_time = time.perf_counter() - step_start
                interval_steps += 1
                interval_step_time += step_time
                interval_tokens += self.batches.step_tokens(step)
                result = StepResult(
                    step=step,
                    max_steps=train.max_steps,
                    device_loss=local_loss,
                    lr=self.engine.lr(),
                    step_time_s=step_time,
                    rank=self.topology.rank,
                )
                if self.on_step_end is not None:
                    self.on_step_end(result)
                last = step == train.max_steps
                saving = last or bool(self.save_steps and step % self.save_steps == 0)
                code = self._after_step(result, vote, final=saving)
                stop_after_save = False
                if code == exitcodes.STOPPED_AT_CHECKPOINT:
                    # Asked to save and stop (a scheduler's warning): this step is saved, then the run
                    # stops; at the last step it simply ends.
                    stop_after_save, saving, code = not last, True, exitcodes.OK
                if code:
                    self.reporter.info(f"stopping at step {step}: a per-step check returned exit code {code}")
                    return code
                self.reporter.advance(step)
                self.steps_this_run += 1
                eval_start = time.perf_counter()
                evaluated = self._evaluate_now(step, last)
                interval_start += time.perf_counter() - eval_start  # eval time is not training throughput
                # Step 1 is logged too: the user sees the starting loss, the launcher a first line, at once.
                logged = step % train.log_every == 0 or last or step == 1 or evaluated is not None
                if logged:
                    if not wait_in_step:
                        # The interval's steps as the device ran them (the loop did not wait in them).
                        _synchronize(self.topology.device)
                        interval_step_time = time.perf_counter() - interval_start
                    loss, node_step_times = self._logged_values(
                        local_loss, interval_step_time / interval_steps
                    )
                    elapsed = time.perf_counter() - interval_start
                    record = {
                        "step": step,
                        "loss": loss,
                        "lr": result.lr,
                        "tokens": interval_tokens,
                        "tokens_per_s": interval_tokens / elapsed,
                        "step_time_s": interval_step_time / interval_steps,
                        "world_size": self.topology.world_size,
                        # Each node's mean over its ranks: a slow node (a throttled GPU, a bad link) shows.
                        "step_time_s_by_node": {f"node{n}": t for n, t in enumerate(node_step_times)},
                    }
                    if evaluated is not None:
                        record["eval_loss"] = evaluated
                    self.reporter.log_step(record)
                    interval_start, interval_steps, interval_step_time, interval_tokens = (
                        time.perf_counter(),
                        0,
                        0.0,
                        0,
                    )
                if saving:
                    if not logged:
                        loss = self._global_loss(float(local_loss))
                    self._save(step, loss)
                    interval_start = time.perf_counter()  # checkpoint time is not training throughput
                if stop_after_save:
                    self.stopped_at = step
                    self.reporter.info(
                        f"stopping at step {step} after its checkpoint, as a signal asked (exit code "
                        f"{exitcodes.STOPPED_AT_CHECKPOINT}: the same command resumes from it)"
                    )
                    return exitcodes.STOPPED_AT_CHECKPOINT
        finally:
            self.reporter.close()
        self._summarize(loss, time.perf_counter() - started, start)
        return exitcodes.OK

    def _evaluate_now(self, step: int, last: bool) -> float | None:
        if self.evaluate is None or not (last or (self.eval_every and step % self.eval_every == 0)):
            return None
        with self._announced("eval"):
            return self.evaluate()

    def _announced(self, phase: str) -> AbstractContextManager[None]:
        return self.announce(phase) if self.announce is not None else nullcontext()

    def _after_step(self, result: StepResult, vote: _StopVote, *, final: bool) -> int:
        """Run the per-step checks; every rank returns the same code (the highest any rank raised),
        on a GPU under async_loss one step later, and at once where `final` (a checkpoint or the end
        follows: nothing is saved past a stop, but STOPPED_AT_CHECKPOINT's, which saves first)."""
        if not self.hooks:
            return exitcodes.OK
        code = next((c for hook in self.hooks if (c := hook(result))), exitcodes.OK)
        return vote.cast(code, final=final)

    def _global_loss(self, local_loss: float) -> float:
        from trainer.node.distributed import mean_across_ranks

        return mean_across_ranks(local_loss, self.topology.device)

    def _logged_values(self, local_loss: float, step_time_s: float) -> tuple[float, list[float]]:
        """The loss averaged over all ranks and each node's mean step time, in the one all-reduce a
        logged step already pays for: [loss, time per node..., ranks per node...], summed."""
        import torch
        import torch.distributed as dist

        nodes, node = self.topology.num_nodes, self.topology.node_rank
        values = torch.zeros(1 + 2 * nodes, dtype=torch.float64, device=self.topology.device)
        values[0] = local_loss
        values[1 + node] = step_time_s
        values[1 + nodes + node] = 1.0
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        totals = values.tolist()
        counts = totals[1 + nodes :]
        times = [t / c if c else float("nan") for t, c in zip(totals[1 : 1 + nodes], counts, strict=True)]
        return totals[0] / dist.get_world_size(), times

    def _resume(self) -> Position:
        from trainer.node.order import START

        if self.resume_from is None:
            return START
        from trainer.node.checkpoint import read_state

        state = read_state(self.resume_from)
        try:
            self.engine.load(self.resume_from)
        except RuntimeError as err:
            if "size mismatch" not in str(err):
                raise
            # A checkpoint of an older trainer, which did not record its vocabulary: the embedding
            # differs in size (the vocabulary changed), found only now.
            mismatch = next(line.strip() for line in str(err).splitlines() if "size mismatch" in line)
            raise ConfigError(
                "checkpoint.resume",
                f"{self.resume_from} does not fit this model ({mismatch[:300]}): the data's vocabulary or "
                "the model changed since it was written; start a new run: another output_dir (or run "
                "name), or checkpoint.resume=never",
            ) from None
        step = int(state["step"])
        self._restore_rng(step)
        position = self._data_position(state, step)
        self.run_facts["resumed_loss"] = state.get("loss", float("nan"))
        self.reporter.info(f"resumed from {self.resume_from} at step {step}")
        return position

    def _restore_rng(self, step: int) -> None:
        """This rank's random streams from its file; a rank without one (the checkpoint was written by
        fewer processes, or the file was deleted) seeds them from train.seed, the step and its rank."""
        from trainer.node.checkpoint import load_rng_state, rng_file, seed_rng, set_rng_state

        rng_path = rng_file(self.resume_from, self.topology.rank)
        if rng_path.is_file():
            set_rng_state(load_rng_state(rng_path))  # checked before the process group started
        else:
            seed_rng(self.train_config.seed, step, self.topology.rank)
        missing = [r for r in range(self.topology.world_size) if not rng_file(self.resume_from, r).is_file()]
        if missing:
            self.reporter.info(
                f"{_ranks(missing)} {'has' if len(missing) == 1 else 'have'} no random state in "
                f"{self.resume_from}: seeded from train.seed, step {step} and the rank"
            )

    def _data_position(self, state: dict[str, Any], step: int) -> Position:
        """Where the data continues: the checkpoint's recorded position in the sample order, which stays
        right at another world size or effective batch; an older checkpoint's step × effective batch.
        Says on one line what changed since the checkpoint was written, if anything did."""
        from trainer.node.order import Position, position_after_steps

        train, world = self.train_config, self.topology.world_size
        effective = self.batches.micro_batch_size * world * train.gradient_accumulation_steps
        length = self.batches.length
        recorded = state.get("data_position")
        name = self.resume_from.name
        if not isinstance(recorded, dict) or "samples_consumed" not in state:
            position = position_after_steps(step, effective_batch=effective, epoch_length=length)
            self.reporter.info(
                f"note: {name} was written by an older trainer that did not record the samples consumed: "
                f"data continues at step {step} × effective batch {effective} = sample "
                f"{position.samples_consumed} (in this trainer's sample order, which differs from the "
                "older one's)"
            )
            return position
        position = Position(
            step=step,
            samples_consumed=int(state["samples_consumed"]),
            epoch=int(recorded["epoch"]),
            offset=int(recorded["epoch_offset"]),
        )
        data = f"data continues at sample {position.samples_consumed}"
        epoch_changed = int(recorded["epoch_length"]) != length
        if epoch_changed:
            # Another data.repeats: the epoch's permutation is another one, a place in it means nothing.
            position = Position(
                step=step, samples_consumed=position.samples_consumed, epoch=position.epoch + 1, offset=0
            )
            data += (
                f", at the start of epoch {position.epoch} (an epoch was {recorded['epoch_length']} samples "
                f"× repeats, now {length})"
            )
        saved_effective = int(recorded["effective_batch"])
        if saved_effective != effective:
            data += f" (the samples consumed, not step × {effective} = {step * effective})"
        batch = [
            f"{what} {saved} -> {now}"
            for what, saved, now in (
                ("micro batch", state.get("micro_batch_size"), self.batches.micro_batch_size),
                ("accumulation", state.get("gradient_accumulation_steps"), train.gradient_accumulation_steps),
            )
            if saved is not None and saved != now
        ]
        saved_world = state.get("world_size")
        if batch or epoch_changed or saved_world != world or saved_effective != effective:
            batch.append(
                f"effective batch {saved_effective} kept"
                if saved_effective == effective
                else f"effective batch {saved_effective} -> {effective}"
            )
            world_part = f"written by {saved_world} processes, now {world}" if saved_world != world else ""
            parts = [part for part in (world_part, ", ".join(batch), data) if part]
            self.reporter.info(f"resuming from {name} ({'; '.join(parts)})")
        return position

    def _save(self, step: int, loss: float) -> None:
        position = self.batches.position_after(step)
        state = {
            "step": step,
            "loss": loss,
            # Where the data continues (trainer.node.order), whatever world size or batch resumes it.
            "samples_consumed": position.samples_consumed,
            "data_position": position.to_state(
                effective_batch=self.batches.effective_batch, epoch_length=self.batches.length
            ),
            "epoch": position.epoch,
            "world_size": self.topology.world_size,
            "micro_batch_size": self.batches.micro_batch_size,
            "gradient_accumulation_steps": self.train_config.gradient_accumulation_steps,
            "engine": self.engine.name,
            "seed": self.train_config.seed,
            "fingerprint": self.fingerprint,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        with self._announced("checkpoint"):
            path = self.checkpoints.save(step, self.engine.save, state)
        self.reporter.info(f"checkpoint {path}")

    def _summarize(self, loss: float, wall_time_s: float, start_step: int) -> None:
        from trainer.node.distributed import gather

        checksums = gather(self.engine.parameter_checksum())
        self.reporter.write_json(
            "summary.json",
            {
                "final_step": self.train_config.max_steps,
                "final_loss": loss,
                "world_size": self.topology.world_size,
                "num_nodes": self.topology.num_nodes,
                "engine": self.engine.name,
                "resumed_from": str(self.resume_from) if self.resume_from else None,
                "steps_this_run": self.train_config.max_steps - start_step,
                "wall_time_s": round(wall_time_s, 3),
                "param_checksums": checksums,
                "ranks_agree": len(set(checksums)) == 1,
            },
        )
        self.reporter.info(
            f"done: step {self.train_config.max_steps}, loss {loss:.4f}, "
            f"parameters identical on all {len(checksums)} ranks: {len(set(checksums)) == 1}"
        )


class _StopVote:
    """The per-step checks' codes, all-reduced (max) across ranks. Deferred (a GPU under async_loss):
    step k's vote is all-reduced on the device and copied to pinned host memory behind step k's work,
    and read at step k+1, after that step's work is queued, so the device never idles for it."""

    def __init__(self, device: str, *, deferred: bool):
        self.device = device
        self.deferred = deferred and device.startswith("cuda")
        self.pending: tuple[Any, Any] | None = None

    def cast(self, code: int, *, final: bool = False) -> int:
        from trainer.node.distributed import max_across_ranks

        if not self.deferred:
            return max_across_ranks(code, self.device)
        import torch
        import torch.distributed as dist

        tensor = torch.full((1,), code, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self.pending = self.pending, (host, event)
        earlier = self._read(previous)
        if earlier or not final:
            return earlier
        latest, self.pending = self.pending, None
        return self._read(latest)

    @staticmethod
    def _read(vote: tuple[Any, Any] | None) -> int:
        if vote is None:
            return exitcodes.OK
        host, event = vote
        event.synchronize()
        return int(host.item())


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _ranks(ranks: list[int]) -> str:
    """ "rank 2", "ranks 2-3" (consecutive), "ranks 1, 3"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)
