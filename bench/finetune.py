"""Fine-tuning throughput: `trainer train` against the Hugging Face `Trainer` (goal: ratio >= 1.0).

Both fine-tune the same Hugging Face model on the same conversations (tokenized by the same code,
only the assistant's tokens trained on), with the same micro-batch, steps, AdamW settings and
cosine schedule, on N processes under torchrun (gloo on the CPU, nccl on GPUs). Throughput is
steady-state tokens/s (real tokens, pads not counted) after the first WARMUP steps. The machine may
be shared, so the two run back to back in rounds, ordered A-B, B-A, B-A, A-B, and the figure is the
geometric mean of each round's ratio (trainer / HF Trainer). The loss is the mean training loss of
the last 10 steps of each, side by side (same data, different sample order: close, not equal).
`--baseline DIR` runs a second checkout of the trainer (another commit) in the same rounds, so a
change is measured before and after under the same load.

    python bench/finetune.py                       # the tiny Qwen2 the tests use, 2 CPU processes
    python bench/finetune.py --rounds 2 --steps 60 --nproc 2
    python bench/finetune.py --model DIR --data FILE --nproc 1 --micro-batch 8 --max-length 512
                             [--gradient-checkpointing] [--lora]      # e.g. a 0.5B model on a GPU
    git worktree add /tmp/before HEAD~1 && python bench/finetune.py --lora --baseline /tmp/before
    python bench/finetune.py --lora --each-off     # also the trainer with each speed-up off in turn
                                                   # (trainer/node/speedups.py), and with all off
    python bench/finetune.py --each-off all        # also the trainer with every speed-up off

On a GPU it also prints MFU: 6 × parameters × tokens/s over the GPU's peak bf16 dense FLOP/s
(--peak-tflops, default 989 for an H100 SXM); attention's own FLOPs are left out, as usual.

The same file is the Hugging Face Trainer worker (`--hf-worker`, started by torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 10
LAST = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, args: list[str], cwd: str, repo: Path = REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=3600, env=env)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done


def overrides(args: argparse.Namespace) -> list[str]:
    """The training settings, as `trainer train --set` pairs; the HF worker reads the same ones."""
    sets = [
        f"model.name_or_path={args.model}", f"data.path={args.data}", f"model.max_length={args.max_length}",
        f"train.max_steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
        "train.learning_rate=0.001", "train.min_lr=0.0001", "train.warmup_steps=5", "train.weight_decay=0.1",
        "train.grad_clip=1.0", "train.seed=1234", f"lora.enabled={args.lora}",
        f"train.gradient_checkpointing={args.gradient_checkpointing}",
        "checkpoint.save_steps=0", "checkpoint.resume=never",
        "distributed.engine=ddp", "train.log_every=1", f"data.packing={args.packing}",
    ]  # fmt: skip
    return sets


def trainer_run(args: argparse.Namespace, workdir: str, repo: Path = REPO, off: str = "") -> dict:
    """`trainer train` from `repo`'s checkout (this one, or --baseline's), with the speed-ups named in
    `off` switched off (TRAINER_SPEEDUPS_OFF)."""
    out = Path(workdir) / "trainer-out"
    sets = [*overrides(args), f"output_dir={out}"]
    previous = os.environ.get("TRAINER_SPEEDUPS_OFF")
    os.environ["TRAINER_SPEEDUPS_OFF"] = off
    started = time.perf_counter()
    try:
        torchrun(
            args.nproc, ["-m", "trainer", "train", *[a for s in sets for a in ("--set", s)]], workdir, repo
        )
        wall = time.perf_counter() - started
    finally:
        os.environ.pop("TRAINER_SPEEDUPS_OFF")
        if previous is not None:
            os.environ["TRAINER_SPEEDUPS_OFF"] = previous
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > WARMUP]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in steady)
    return {
        "tokens_per_s": sum(r["tokens"] for r in steady) / seconds,
        "loss": statistics.mean(r["loss"] for r in records[-LAST:]),
        "wall_s": wall,
    }


def hf_run(args: argparse.Namespace, workdir: str) -> dict:
    extra = ["--gradient-checkpointing"] if args.gradient_checkpointing else []
    extra += ["--lora"] if args.lora else []
    extra += ["--packing"] if args.packing else []
    started = time.perf_counter()
    done = torchrun(
        args.nproc,
        [__file__, "--hf-worker", "--model", args.model, "--data", args.data, "--steps", str(args.steps),
         "--micro-batch", str(args.micro_batch), "--max-length", str(args.max_length), *extra],
        workdir,
    )  # fmt: skip
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


def hf_worker(args: argparse.Namespace) -> None:
    """The Hugging Face Trainer on the same samples with the same settings."""
    import torch
    import torch.distributed as dist
    from transformers import (
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from trainer.node.config import load_config
    from trainer.node.hf.job import FineTune

    config = load_config(None, overrides(args))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = FineTune.prepare(config, world)  # the same tokenized samples the trainer trains on
    dataset = [_row(job, i) for i in range(len(job.rows))]
    pad = job.tokenizer.pad_token_id if job.tokenizer.pad_token_id is not None else job.tokenizer.eos_token_id
    counted = {"tokens": 0}

    def collate(features):
        counted["tokens"] += sum(len(f["input_ids"]) for f in features)
        width = max(len(f["input_ids"]) for f in features)
        batch = {
            "input_ids": [f["input_ids"] + [pad] * (width - len(f["input_ids"])) for f in features],
            "labels": [f["labels"] + [-100] * (width - len(f["labels"])) for f in features],
        }
        if args.packing:  # each packed sample restarts its positions; the pads are one more sample
            batch["position_ids"] = [
                f["position_ids"] + list(range(width - len(f["input_ids"]))) for f in features
            ]
        return {key: torch.tensor(value) for key, value in batch.items()}

    cuda = torch.cuda.is_available()
    train = config.train
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32 if not (cuda and args.lora) else torch.bfloat16
    )
    if args.lora:
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear",
                                   task_type="CAUSAL_LM")
        )  # fmt: skip
    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            if state.global_step in (WARMUP, train.max_steps):
                if cuda:
                    torch.cuda.synchronize()
                marks[state.global_step] = (time.perf_counter(), counted["tokens"])

    with tempfile.TemporaryDirectory() as out:
        arguments = TrainingArguments(
            output_dir=out, per_device_train_batch_size=train.micro_batch_size, max_steps=train.max_steps,
            learning_rate=train.learning_rate, lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr": train.min_lr}, warmup_steps=train.warmup_steps,
            weight_decay=train.weight_decay, adam_beta2=0.99, max_grad_norm=train.grad_clip, seed=train.seed,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda, bf16=cuda,
            ddp_backend=None if cuda else "gloo", dataloader_drop_last=True, remove_unused_columns=False,
            disable_tqdm=True, gradient_checkpointing=args.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=arguments, train_dataset=dataset, data_collator=collate, callbacks=[Clock()]
        )
        trainer.train()
        # Logged every step, like the trainer's run (each costs both one all-reduce of the loss).
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    (start, start_tokens), (end, end_tokens) = marks[WARMUP], marks[train.max_steps]
    rate = torch.tensor([(end_tokens - start_tokens) / (end - start)], dtype=torch.float64)
    if dist.is_initialized():  # every rank counted its own tokens
        rate = rate.to("cuda" if cuda else "cpu")
        dist.all_reduce(rate)
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            json.dumps({"tokens_per_s": float(rate.item()), "loss": statistics.mean(losses[-LAST:])}),
            flush=True,
        )


def _row(job, index: int) -> dict:
    """A training row as plain lists: one sample, or (packing) several with their positions restarted."""
    input_ids, labels, positions = [], [], []
    for sample in job.rows.row(index):
        ids, sample_labels = job.train.sample(int(sample))
        input_ids += ids.tolist()
        labels += [-100, *sample_labels[1:].tolist()]  # never predict a sample's first token from the last
        positions += list(range(len(ids)))
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}


def build_tiny(workdir: str) -> tuple[str, str]:
    model, data = Path(workdir) / "tiny-qwen2", Path(workdir) / "conversations.json"
    script = REPO / "scripts" / "build_tiny_hf_model.py"
    for command in (["model", str(model)], ["data", str(data), "--samples", "2000"]):
        subprocess.run([sys.executable, str(script), *command], check=True, capture_output=True, timeout=600)
    return str(model), str(data)


def parameter_count(model: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in skeleton.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--model", help="a Hugging Face model directory (default: build the tiny Qwen2)")
    parser.add_argument("--data", help="conversations (default: the builder's 2000 conversations)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--packing", action="store_true", help="both train on the same packed rows")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's bf16 dense peak")
    parser.add_argument(
        "--baseline", type=Path, help="another checkout of this repository, run in the same rounds"
    )
    parser.add_argument(
        "--each-off",
        nargs="?",
        const="each",
        metavar="NAMES",
        help="in each round, also the trainer with each speed-up off alone and with all off; or with "
        "the comma-separated NAMES off in turn (`all`: every one at once)",
    )
    parser.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        hf_worker(args)
        return
    with tempfile.TemporaryDirectory() as workdir:
        if not args.model:
            args.model, built_data = build_tiny(workdir)
            args.data = args.data or built_data
        if not args.data:
            parser.error("--data is needed with --model")
        ratios, ours, theirs, baseline_ratios = [], [], [], []
        from trainer.node.speedups import SPEEDUPS

        each_off = [*SPEEDUPS, "all"] if args.each_off == "each" else (args.each_off or "").split(",")
        each_off = [name for name in each_off if name]
        off_ratios: dict[str, list[float]] = {name: [] for name in each_off}
        for round_index in range(args.rounds):
            order = ("trainer", "hf") if round_index % 4 in (0, 3) else ("hf", "trainer")
            if args.baseline:  # each contestant first, middle and last in turn
                order = [("trainer", "baseline", "hf"), ("hf", "trainer", "baseline"),
                         ("baseline", "hf", "trainer")][round_index % 3]  # fmt: skip
            results = {}
            for name in order:
                if name == "hf":
                    results[name] = hf_run(args, workdir)
                else:
                    results[name] = trainer_run(args, workdir, args.baseline if name == "baseline" else REPO)
            # Each speed-up off alone, against the trainer with all on measured just before or after.
            names = each_off if round_index % 2 == 0 else each_off[::-1]
            for name in names:
                rate = trainer_run(args, workdir, REPO, off=name)["tokens_per_s"]
                off_ratios[name].append(rate / results["trainer"]["tokens_per_s"])
            ratio = results["trainer"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
            ratios.append(ratio)
            ours.append(results["trainer"])
            theirs.append(results["hf"])
            mine, hf = results["trainer"], results["hf"]
            before = ""
            if args.baseline:
                baseline_ratios.append(results["baseline"]["tokens_per_s"] / hf["tokens_per_s"])
                before = (
                    f", baseline {results['baseline']['tokens_per_s']:,.0f} tok/s, "
                    f"ratio {baseline_ratios[-1]:.3f}"
                )
            print(
                f"round {round_index + 1} ({' then '.join(order)}): "
                f"trainer {mine['tokens_per_s']:,.0f} tok/s, "
                f"HF Trainer {hf['tokens_per_s']:,.0f} tok/s, ratio {ratio:.3f}{before}; "
                f"loss (last {LAST} steps) {mine['loss']:.4f} vs {hf['loss']:.4f}; "
                f"process wall {mine['wall_s']:.1f} s vs {hf['wall_s']:.1f} s",
                flush=True,
            )
        mean = statistics.geometric_mean
        options = (", LoRA" if args.lora else "") + (", packing" if args.packing else "")
        options += ", gradient checkpointing" if args.gradient_checkpointing else ""
        loss_ours, loss_theirs = (statistics.mean(r["loss"] for r in results) for results in (ours, theirs))
        print(
            f"\n{args.nproc} process(es), micro-batch {args.micro_batch}, {args.steps} steps, max_length "
            f"{args.max_length}{options}\n"
            f"throughput ratio trainer / HF Trainer: {mean(ratios):.3f} (geometric mean of {len(ratios)} "
            f"rounds; min {min(ratios):.3f}, max {max(ratios):.3f}; goal >= 1.0)\n"
            f"final loss (mean of the last {LAST} steps): trainer {loss_ours:.4f}, "
            f"HF Trainer {loss_theirs:.4f}\n"
            f"torchrun's wall, start-up and every step (median): trainer "
            f"{statistics.median(r['wall_s'] for r in ours):.1f} s, HF Trainer "
            f"{statistics.median(r['wall_s'] for r in theirs):.1f} s"
        )
        for name, values in off_ratios.items():
            print(
                f"trainer with {name} off / all on: {mean(values):.3f} (geometric mean of {len(values)} "
                f"rounds; min {min(values):.3f}, max {max(values):.3f})"
            )
        if args.baseline:
            print(
                f"baseline ({args.baseline}) / HF Trainer: {mean(baseline_ratios):.3f}; "
                f"this checkout / baseline: {mean(ratios) / mean(baseline_ratios):.3f}"
            )
        import torch

        if torch.cuda.is_available():
            parameters = parameter_count(args.model)
            for name, results in (("trainer", ours), ("HF Trainer", theirs)):
                rate = statistics.median(r["tokens_per_s"] for r in results)
                mfu = 6 * parameters * rate / (args.nproc * args.peak_tflops * 1e12)
                size = f"{parameters / 1e6:.0f}M parameters"
                print(f"{name}: {rate:,.0f} tok/s, MFU {mfu:.1%} ({size}, 6·N·tokens)")


if __name__ == "__main__":
    main()
