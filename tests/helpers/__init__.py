"""What the test modules share: clusters on this machine (loopback, local_sshd, slurm_cluster), the
test bed's nodes and launches (testbed_nodes, bed_launch), trainer runs (trainer_harness,
finetune_harness, prepared_harness), pushes, fake launches, a webhook server, inventories to plan.

Test modules import from here (`from helpers.loopback import write_inventory`), never from each
other; pytest finds the package through `pythonpath = ["tests"]` in pyproject.toml."""
