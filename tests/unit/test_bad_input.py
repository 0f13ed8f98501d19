"""Careless input gets a clear error naming the file or key (exit 2), never a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer import exitcodes
from trainer.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_a_config_that_is_not_utf8_is_named(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_bytes("train:\n  max_steps: 5  # café\n".encode("latin-1"))
    assert main(["train", "--dry-run", "--config", str(config)]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"--config: {config} is not UTF-8 text (byte 0xe9 at offset" in err
    assert "save it as UTF-8" in err and "Traceback" not in err


def test_a_block_larger_than_the_text_is_a_config_error_in_a_dry_run(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("x" * 50)
    args = ["train", "--dry-run", "--set", f"data.path={data}", "--set", "data.block_size=64"]
    assert main(args) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "data.block_size: 64 is too large for the text of data.path (50 characters)" in err
    assert "use a smaller data.block_size" in err
    # One character short of a sample is still too little; one sample is enough to size the run.
    data.write_text("x" * 64)
    assert main(args) == exitcodes.CONFIG_ERROR
    data.write_text("x" * 65)
    assert main([*args, "--set", "data.allow_dataset_oversubscription=true"]) == exitcodes.OK


def test_an_inventory_with_a_yaml_syntax_error_names_the_file_line_and_cause(tmp_path, capsys):
    inventory = tmp_path / "inventory"
    shutil.copytree(REPO / "inventory" / "local", inventory)
    hosts = inventory / "hosts.yml"
    lines = hosts.read_text().splitlines()
    # A mapping with its closing brace lost, as an editor slip leaves it.
    lines.insert(1, "  vars: {broken: 1")
    hosts.write_text("\n".join(lines) + "\n")
    assert main(["plan", "-i", str(inventory)]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"inventory {hosts}, line " in err and "not valid YAML" in err
    assert "found 0" not in err and "Traceback" not in err

    (inventory / "group_vars" / "all").mkdir(exist_ok=True, parents=True)
    hosts.write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    bad_vars = inventory / "group_vars" / "all" / "zz-typo.yml"
    bad_vars.write_text("cluster_shared_dir: [/srv/share\n")
    assert main(["plan", "-i", str(inventory)]) == exitcodes.CONFIG_ERROR
    assert f"inventory {bad_vars}, line " in capsys.readouterr().err


def test_running_the_command_in_process_leaves_the_callers_umask_alone(capsys):
    previous = os.umask(0o022)
    try:
        assert main(["train", "--dry-run", "--set", "train.max_steps=2"]) == exitcodes.OK
    finally:
        assert os.umask(previous) == 0o022, "trainer train's umask 027 leaked into its caller"


def _memory_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("MemTotal", "SwapTotal"))


def test_a_model_too_big_for_memory_is_refused_before_the_output_dir_exists(tmp_path, capsys):
    out = tmp_path / "out"
    # About 320 billion parameters: 16 bytes each for weights, gradients and AdamW's moments.
    args = ["--set", f"output_dir={out}", "--set", "model.n_embd=16384", "--set", "model.n_layer=100"]
    assert main(["train", *args]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "config error: model: the model does not fit in memory: 322,128,576,512 parameters need" in err
    assert "TiB for weights, gradients and optimizer state" in err
    assert "is available (MemAvailable + SwapFree in /proc/meminfo)" in err
    assert "smaller model" in err and "lora.enabled=true" in err and "zero_stage=3" in err
    assert "Traceback" not in err
    assert not out.exists(), "output_dir was created for a run that cannot start"
    # Under DeepSpeed the estimate is DeepSpeed's (fp32 master copies, sharded state): still too big.
    zero3 = ["--set", "distributed.engine=deepspeed", "--set", "distributed.zero_stage=3"]
    assert main(["train", *args, *zero3]) == exitcodes.CONFIG_ERROR
    assert "per process, deepspeed)" in capsys.readouterr().err
    assert not out.exists()


def test_an_allocation_that_fails_while_the_model_is_built_is_the_same_clear_error(tmp_path):
    # With the optimizer offloaded by the user's DeepSpeed JSON the estimate steps aside; one layer whose
    # weight alone is larger than the machine's memory (and swap) then fails in the allocator itself.
    import math
    import subprocess
    import sys

    width = 4 * math.ceil(math.sqrt(2 * _memory_bytes() / 12) / 4)  # qkv: 3 × width² fp32 > 2 × memory
    ds_json = tmp_path / "offload.json"
    ds_json.write_text('{"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}}}')
    out = tmp_path / "out"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "trainer"), "train", *[
            arg for pair in (f"output_dir={out}", f"model.n_embd={width}", "model.n_layer=1",
                             "distributed.engine=deepspeed", f"distributed.deepspeed_config={ds_json}")
            for arg in ("--set", pair)
        ]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == exitcodes.CONFIG_ERROR, done.stderr[-3000:]
    assert "config error: model: the model does not fit in memory: allocating it failed" in done.stderr
    assert "can't allocate memory" in done.stderr and "lora.enabled=true" in done.stderr
    assert "Traceback" not in done.stderr
