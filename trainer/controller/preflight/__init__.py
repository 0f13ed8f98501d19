"""`trainer preflight`: check a cluster before a launch, host by host and pair by pair.

Every manual check and troubleshooting step of the multi-node guides runs for real on the nodes,
against the live thing rather than the configuration: the job's topology as launch builds it, SSH
trust, the master port, ufw, the NCCL/gloo interface, equal accelerators and versions, DeepSpeed's
ops and build locks, chronyd and the clocks, the NFS server and mounts, the shared dir, free space,
the data checksum, bandwidth, and a tiny DeepSpeed job followed phase by phase. This package turns
what the nodes report into pass/fail lines with the host and the fix, and a JSON report.
"""
