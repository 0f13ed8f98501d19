"""`trainer preflight`: check a cluster before a launch, host by host and pair by pair.

Every manual check and troubleshooting step of the multi-node guides (SSH trust, the master port,
ufw, equal accelerators and versions, clocks, the shared dir, the data checksum, bandwidth, a tiny
DeepSpeed checkpoint) runs for real on the nodes through Ansible; this package turns what the
nodes report into pass/fail lines with the fix, and a JSON report.
"""
