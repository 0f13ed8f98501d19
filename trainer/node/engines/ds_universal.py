"""A DeepSpeed ZeRO checkpoint resumed by another number of processes, through DeepSpeed's own
universal checkpoint.

ZeRO 1, 2 and 3 write the optimizer state (and with ZeRO-3 the weights) as one flat shard per process,
cut for that many processes: a checkpoint written by W processes cannot be loaded as it is by W' != W.
DeepSpeed's answer is its universal checkpoint: `deepspeed.checkpoint.ds_to_universal` gathers the
shards into one file per parameter and state (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`,
`step.pt`), and `load_checkpoint` with the config's `checkpoint.load_universal` on cuts them again for
any number of processes. Weights, Adam's moments and step counts, the parameter groups and the LR
scheduler come back as saved, for every ZeRO stage (tests/local/test_ds_resize.py compares them, gathered
to full tensors, before the save and after the load).

When it happens (`prepare`, every rank, inside DeepSpeedEngine.load, before DeepSpeed loads): the
checkpoint's state file says how many processes wrote it; the same number loads the shards as before,
no conversion. Otherwise rank 0 converts once, into the checkpoint itself, following the protocol of
trainer.node.checkpoint (complete or absent):
  1. a leftover of an interrupted conversion (`step-N/.tmp-universal-*`) is removed (also by a resume
     at the same world size, which converts nothing);
  2. ds_to_universal runs in a child process into `step-N/.tmp-universal-<pid>/` (a child: its worker
     pool must not fork a trainer that holds a process group, and its memory is returned at its end);
  3. the directory is renamed to `step-N/universal/` (atomic), which from then on is reused by any run
     resuming step-N at any other world size. It goes when step-N goes (save_total_limit).
`latest`, the state file and the original shards are only read: a crash at any moment leaves step-N
as it was, plus a `.tmp-universal-*` the next resume of it removes. The other ranks wait for rank 0 in
a collective that also carries its outcome, so a failed conversion ends every rank with the same
ConfigError (exit 2, said once by rank 0; DiskFull, exit 74, for a full disk; the checkpoint stays
usable by its own world size) and none is left waiting. The wait is bounded by distributed.timeout_s:
the conversion gets 90% of it. The converted files are checked like the checkpoint (check_trusted)
before they are loaded.

Random state: a rank that had no rng-rank<R>.pt at save time (more processes now) is seeded from
(train.seed, step, rank) by the loop (trainer.node.checkpoint.seed_rng); files of ranks that no longer
exist are not read. The data order is the sample order's (trainer.node.order): the same samples per
step at any world size with the same effective batch.

Test hooks: TRAINER_TEST_UNIVERSAL_DELAY_S=<seconds> makes rank 0 sleep after the conversion wrote its
temporary directory and before the rename (a test kills the run there); TRAINER_TEST_OPTIMIZER_DUMP=
<dir> makes rank 0 write every parameter's full fp32 weight, Adam moments and steps, the parameter
groups and the scheduler's state after each save and load (dump_optimizer_state).

torch and DeepSpeed are imported inside functions (and in the converter's own process).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError
from trainer.node.checkpoint import UNIVERSAL_DIR

UNIVERSAL = UNIVERSAL_DIR
TMP_PREFIX = ".tmp-universal-"
DELAY_ENV = "TRAINER_TEST_UNIVERSAL_DELAY_S"
DUMP_ENV = "TRAINER_TEST_OPTIMIZER_DUMP"
#: What ds_to_universal writes last for ZeRO 1/2 and 3: its presence in the temporary directory means
#: the conversion finished (checked before the rename, in case the tool exits 0 without it).
DONE_MARKER = "latest_universal"
#: The conversion's share of distributed.timeout_s: the other ranks wait that long at most, and rank 0
#: must still tell them why it gave up.
TIMEOUT_SHARE = 0.9


def universal_dir(checkpoint: Path) -> Path:
    return checkpoint / UNIVERSAL


def prepare(
    checkpoint: Path,
    *,
    tag: str,
    saved_world_size: int,
    world_size: int,
    is_main: bool,
    timeout_s: float,
    share: Callable[[Any], Any],
    say: Callable[[str], None],
) -> Path | None:
    """The universal checkpoint to load instead of checkpoint's own shards, or None (same world size:
    load them as they are). Call on every rank. share: rank 0's value on every rank (a collective).
    ConfigError on every rank if the conversion failed."""
    if is_main:  # before anything else, the same world size too: the space it holds is freed
        for leftover in checkpoint.glob(TMP_PREFIX + "*"):
            say(f"removing an interrupted conversion of {checkpoint.name} ({leftover})")
            shutil.rmtree(leftover, ignore_errors=True)
    if saved_world_size == world_size:
        return None
    outcome = _convert_once(checkpoint, tag, timeout_s=timeout_s) if is_main else None
    outcome = share(outcome)  # every rank waits here for rank 0's conversion
    kind, detail = outcome
    done = f"resuming {checkpoint.name} written by {saved_world_size} processes on {world_size}"
    if kind == "no_space":
        from trainer.node.checkpoint import DiskFull

        raise DiskFull(
            f"{done}: no space left on device to convert it to DeepSpeed's universal checkpoint in "
            f"{checkpoint} ({detail}); {checkpoint.name} is intact; free space there, then run the same "
            f"command again (or resume with {saved_world_size} processes: no conversion)",
            everywhere=True,
        )
    if kind == "failed":
        raise ConfigError(
            "checkpoint.resume",
            f"{done}: converting it to DeepSpeed's universal checkpoint failed ({detail}); {checkpoint} is "
            f"intact: resume it with {saved_world_size} processes, or another checkpoint "
            "(checkpoint.resume=PATH), or start over with checkpoint.resume=never",
        )
    target = universal_dir(checkpoint)
    from trainer.node.checkpoint import check_trusted

    check_trusted(target)  # what DeepSpeed unpickles next, written since check_resumable looked
    if kind == "converted":
        say(f"{done}: converted to DeepSpeed's universal checkpoint ({detail:.1f} s)")
    else:
        say(f"{done}: DeepSpeed's universal checkpoint converted before ({target})")
    return target


def _convert_once(checkpoint: Path, tag: str, *, timeout_s: float) -> tuple[str, Any]:
    """Rank 0: ("reused", None), ("converted", seconds) or ("failed", why). Never raises: the other
    ranks are waiting for its answer."""
    target = universal_dir(checkpoint)
    if target.is_dir():
        return "reused", None
    started = time.perf_counter()
    tmp = checkpoint / f"{TMP_PREFIX}{os.getpid()}"
    try:
        tmp.mkdir()
        _run_converter(checkpoint / tag, tmp / tag, timeout_s=timeout_s * TIMEOUT_SHARE)
        if not (tmp / DONE_MARKER).is_file():
            raise RuntimeError(f"ds_to_universal exited without writing {DONE_MARKER}")
        _test_delay()
        os.rename(tmp, target)
    except Exception as error:  # the tool's own failure, a full disk, a timeout: every rank is told
        shutil.rmtree(tmp, ignore_errors=True)
        return _failure(error, checkpoint / tag)
    return "converted", time.perf_counter() - started


class ConversionFailed(RuntimeError):
    """ds_to_universal exited with an error; the message is the last line it printed."""


def _run_converter(source: Path, output: Path, *, timeout_s: float) -> None:
    """DeepSpeed's converter in a child process (`python -m trainer.node.engines.ds_universal`, which
    dies with this process: a killed trainer leaves no converter writing behind it)."""
    workers = max(1, min(8, os.cpu_count() or 1))
    command = [
        sys.executable, "-m", __name__,
        "--input_folder", str(source), "--output_folder", str(output),
        # Our checkpoints have no Megatron tensor/pipeline parallel metadata: data parallel only.
        "--inject_missing_state",
        "--num_extract_workers", str(workers),
        # Merging holds a whole parameter's slices at once: fewer workers than extraction.
        "--num_merge_workers", str(max(1, workers // 2)),
    ]  # fmt: skip
    # The conversion is CPU work: no GPU context in the child, and no progress bars in its output.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "TQDM_DISABLE": "1"}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    ) as child:
        try:
            output_text, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            raise TimeoutError(
                f"it took longer than {timeout_s:.0f} s, 90% of distributed.timeout_s: raise that"
            ) from None
        except BaseException:
            _kill_group(child)
            raise
    if child.returncode != 0:
        lines = [line.strip() for line in output_text.strip().splitlines() if line.strip()]
        raise ConversionFailed(lines[-1] if lines else f"ds_to_universal exited {child.returncode}")


def _kill_group(child: subprocess.Popen) -> None:
    """The converter and its worker pool (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _failure(error: BaseException, source: Path) -> tuple[str, str]:
    """("no_space", sizes) for a full disk, else ("failed", the error in one line)."""
    from trainer.node.checkpoint import disk_usage, free_bytes, human_size, says_no_space

    if says_no_space(error):
        return "no_space", (
            f"it needs about {human_size(disk_usage(source))}, {human_size(free_bytes(source))} free"
        )
    text = (str(error).strip().splitlines() or [""])[0]
    if len(text) > 200:  # torch's errors go on with advice for its own users: the first sentence
        cut = text.find(". ", 40, 300)
        text = text[: cut + 1] if cut > 0 else text[:300]
    return "failed", text if isinstance(
        error, ConversionFailed | TimeoutError
    ) else f"{type(error).__name__}: {text}"


def _test_delay() -> None:
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    if delay > 0:
        time.sleep(delay)


def dump_optimizer_state(engine, directory: Path, event: str) -> None:
    """Test hook (DUMP_ENV): rank 0 writes `<dump dir>/<event>-<step-N>-w<W>.pt` with every trained
    parameter's full fp32 weight, exp_avg and exp_avg_sq (gathered from the shards by DeepSpeed's own
    safe_get_full_* API, not from the checkpoint files), the Adam step counts, the parameter groups'
    hyperparameters and the LR scheduler's state. Call on every rank (the gathers are collectives)."""
    target = os.environ.get(DUMP_ENV)
    if not target:
        return
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO 1/2 link each parameter to its Adam state once, after the first step, and (DeepSpeed
        # 0.19) find state only in the first parameter group then: the biases' and norms' group would
        # read as missing. Linking again now sees every group's state (views, nothing changes).
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        params[name] = {
            "fp32": safe_get_full_fp32_param(param).detach().cpu().clone(),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg").detach().cpu().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").detach().cpu().clone(),
        }
    base = optimizer.optimizer  # the trainer's AdamW over ZeRO's flat fp32 partitions
    steps = sorted({float(state["step"]) for state in base.state.values() if "step" in state})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    if dist.get_rank() != 0:
        return
    groups = [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
    step_name = directory.name.removeprefix(".tmp-")
    path = Path(target) / f"{event}-{step_name}-w{dist.get_world_size()}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "params": params,
            "steps": sorted({s for rank_steps in gathered for s in rank_steps}),
            "param_groups": groups,
            "scheduler": engine.lr_scheduler.state_dict(),
        },
        path,
    )


def _converter_main(argv: list[str]) -> None:
    """The child process: dies with the trainer that started it, its worker pool with it; then
    DeepSpeed's converter as it is."""
    if sys.platform.startswith("linux"):
        import ctypes

        # The trainer's death sends us SIGTERM (PR_SET_PDEATHSIG); we then kill our own process group
        # (start_new_session made it ours): the pool's workers, which the signal does not reach.
        signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() == 1:  # the trainer died before prctl took effect
            sys.exit(1)
    # Imported, not run as __main__: its worker pool pickles the module's functions by their names.
    from deepspeed.checkpoint import ds_to_universal

    sys.argv = ["ds_to_universal", *argv]
    ds_to_universal.main(ds_to_universal.parse_arguments())


if __name__ == "__main__":
    _converter_main(sys.argv[1:])
