"""Exit codes shared by the trainer, the launcher and preflight, so orchestrators can tell causes apart."""

OK = 0
#: Training or launching failed for a reason not listed below (see the log).
FAILURE = 1
#: The configuration, inventory or command line is invalid; nothing was started or changed.
CONFIG_ERROR = 2
#: The dataset cannot fill one effective batch (see the error for the four ways out).
DATA_ERROR = 3
#: A node of the job was lost (it stopped answering while its peers' collectives failed) and the job
#: could not go on without it (sysexits' EX_UNAVAILABLE).
NODE_LOST = 69
#: A stall whose culprit the kernel names (sysexits' EX_OSERR): a rank stopped by a signal (state T),
#: blocked in uninterruptible sleep (state D, on a hung mount or device: its node is at fault), or gone
#: while its peers wait in their collective (launcher/hang.py).
HUNG = 71
#: Ctrl-C, TERM or HUP: the launcher stopped every node and ended (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130
#: A GPU health check tripped the circuit breaker; the node's hardware needs attention.
GPU_FAULT = 75
#: Preflight found at least one failing check.
PREFLIGHT_FAILED = 4
#: output_dir's file system is full (sysexits' EX_IOERR): the previous checkpoint is intact and stays
#: `latest`; free space and run the same command again to resume.
NO_SPACE = 74
#: The run stopped at a checkpoint on request (SIGUSR2 to a rank: Slurm's `--signal=USR2@SECONDS`
#: before a time limit or a preemption) and resumes where it stopped: run the same command again
#: (inside a Slurm job, `trainer launch` requeues the job itself).
STOPPED_AT_CHECKPOINT = 5
