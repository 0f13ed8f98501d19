"""The training loop: resume, then per step train → per-step checks → log → save; then the summary.

The loop gets the sections it needs, not the whole config (`trainer.node.config` imports the
sections' modules, so none of them imports it). Per-step checks (e.g. a GPU health circuit breaker)
are `StepHook`s: each gets the step's result and returns None to continue or an exit code to stop;
`Trainer._after_step` is the one place they run, and all ranks stop together with the same code.

torch is imported inside functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer import exitcodes
from trainer.configerror import ConfigError

if TYPE_CHECKING:
    from trainer.node.checkpoint import CheckpointWriter
    from trainer.node.data import ShardedBatches
    from trainer.node.distributed import Topology
    from trainer.node.engines import Batch, Engine
    from trainer.node.metrics import Reporter
    from trainer.node.schedule import TrainConfig


@dataclass(frozen=True)
class StepResult:
    """What a per-step check sees after each optimizer step."""

    step: int
    max_steps: int
    loss: float
    """This rank's mean loss over the step's micro-batches."""
    lr: float
    step_time_s: float
    rank: int


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
    batches: ShardedBatches
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
    run_facts: dict[str, Any] = field(default_factory=dict)
    steps_this_run: int = 0

    def train(self) -> int:
        train = self.train_config
        start = self._resume()
        if start >= train.max_steps:
            self.reporter.info(
                f"already trained to step {start} ({self.resume_from}): nothing to do. Raise train.max_steps "
                "to train further, or set checkpoint.resume=never (or another output_dir) to start over"
            )
        self.reporter.start(first_step=start + 1, resumed_step=start)
        accumulation = train.gradient_accumulation_steps
        interval_start, interval_steps, interval_step_time, interval_tokens = time.perf_counter(), 0, 0.0, 0
        loss = self.run_facts.get("resumed_loss", float("nan"))
        started = time.perf_counter()
        try:
            for step in range(start + 1, train.max_steps + 1):
                if self.on_step_start is not None:
                    self.on_step_start(step)
                step_start = time.perf_counter()
                local_loss = self.engine.train_step(self._micro_batches(step))
                step_time = time.perf_counter() - step_start
                interval_steps += 1
                interval_step_time += step_time
                interval_tokens += self.batches.step_tokens((step - 1) * accumulation, accumulation)
                result = StepResult(
                    step=step,
                    max_steps=train.max_steps,
                    loss=local_loss,
                    lr=self.engine.lr(),
                    step_time_s=step_time,
                    rank=self.topology.rank,
                )
                code = self._after_step(result)
                if code:
                    self.reporter.info(f"stopping at step {step}: a per-step check returned exit code {code}")
                    return code
                self.reporter.advance(step)
                self.steps_this_run += 1
                last = step == train.max_steps
                eval_start = time.perf_counter()
                evaluated = self._evaluate_now(step, last)
                interval_start += time.perf_counter() - eval_start  # eval time is not training throughput
                # Step 1 is logged too: the user sees the starting loss, the launcher a first line, at once.
                logged = step % train.log_every == 0 or last or step == 1 or evaluated is not None
                if logged:
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
                if last or (self.save_steps and step % self.save_steps == 0):
                    if not logged:
                        loss = self._global_loss(local_loss)
                    self._save(step, loss)
                    interval_start = time.perf_counter()  # checkpoint time is not training throughput
        finally:
            self.reporter.close()
        self._summarize(loss, time.perf_counter() - started, start)
        return exitcodes.OK

    def _evaluate_now(self, step: int, last: bool) -> float | None:
        if self.evaluate is None or not (last or (self.eval_every and step % self.eval_every == 0)):
            return None
        return self.evaluate()

    def _after_step(self, result: StepResult) -> int:
        """Run the per-step checks; every rank returns the same code (the highest any rank raised)."""
        if not self.hooks:
            return exitcodes.OK
        from trainer.node.distributed import max_across_ranks

        code = next((c for hook in self.hooks if (c := hook(result))), exitcodes.OK)
        return max_across_ranks(code, self.topology.device)

    def _micro_batches(self, step: int) -> Iterator[Batch]:
        # The data position is a pure function of the step, so resuming at a step resumes the data.
        accumulation = self.train_config.gradient_accumulation_steps
        first = (step - 1) * accumulation
        for position in range(first, first + accumulation):
            yield self.batches.batch(position)

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

    def _resume(self) -> int:
        if self.resume_from is None:
            return 0
        from trainer.node.checkpoint import load_rng_state, read_state, rng_file, set_rng_state

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
        rng_path = rng_file(self.resume_from, self.topology.rank)
        if state.get("world_size") != self.topology.world_size:
            self.reporter.info(
                f"warning: {self.resume_from} was written by {state.get('world_size')} processes, "
                f"this run has {self.topology.world_size}: data order and random streams differ from an "
                "uninterrupted run"
            )
        if rng_path.is_file():
            set_rng_state(load_rng_state(rng_path))  # checked before the process group started
        self.run_facts["resumed_loss"] = state.get("loss", float("nan"))
        self.reporter.info(f"resumed from {self.resume_from} at step {state['step']}")
        return int(state["step"])

    def _save(self, step: int, loss: float) -> None:
        accumulation = self.train_config.gradient_accumulation_steps
        state = {
            "step": step,
            "loss": loss,
            "micro_batches_consumed": step * accumulation,
            "epoch": (step * accumulation) // self.batches.batches_per_epoch,
            "world_size": self.topology.world_size,
            "engine": self.engine.name,
            "seed": self.train_config.seed,
            "fingerprint": self.fingerprint,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
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
