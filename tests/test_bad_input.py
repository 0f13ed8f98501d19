"""Careless input gets a clear error naming the file or key (exit 2), never a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trainer import exitcodes
from trainer.cli import main

REPO = Path(__file__).resolve().parents[1]


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
