"""Checkpoints: OUTPUT_DIR/checkpoints/step-<N>/ and `latest`, complete or absent, resumed exactly.

One module per concern, every public name re-exported here:
- `layout`: the paths (step-N directories, `latest`, the state file), the `checkpoint` config section,
  which checkpoint a run resumes from, how many are kept, the leftovers of an interrupted write;
- `identity`: what a checkpoint records of its run (the resume fingerprint, content hashes) and why a
  run that differs is refused;
- `resume`: the checks on every rank before a resume loads anything (trusted files, RNG files, identity);
- `rng`: each rank's random generators as tensor-only files;
- `space`: room on the disk for the next checkpoint, and DiskFull;
- `writer`: the atomic save (CheckpointWriter), the protocol in its docstring.

torch is imported inside functions: the config section is loaded on the controller.
"""

from __future__ import annotations

from trainer.node.checkpoint.identity import (
    IDENTITY_KEYS,
    content_hash,
    file_hash,
    resume_fingerprint,
)
from trainer.node.checkpoint.layout import (
    CHECKPOINT_LEFTOVERS,
    LATEST,
    LEGACY_STATE_FILES,
    OUTPUT_DIR_LEFTOVERS,
    STATE_FILE,
    TMP_PREFIX,
    UNIVERSAL_DIR,
    CheckpointConfig,
    checkpoints_dir,
    complete_checkpoints,
    find_resume_point,
    is_complete,
    latest_checkpoint,
    leftovers,
    read_state,
    remove_leftovers,
    state_path,
)
from trainer.node.checkpoint.resume import check_resumable, check_trusted
from trainer.node.checkpoint.rng import (
    RNG_FORMAT,
    load_rng_state,
    rng_file,
    rng_state,
    seed_rng,
    set_rng_state,
)
from trainer.node.checkpoint.space import (
    NO_SPACE_ERRNOS,
    DiskFull,
    disk_usage,
    free_bytes,
    human_size,
    is_disk_full,
    no_space_message,
    says_no_space,
    space_problem,
)
from trainer.node.checkpoint.writer import DELAY_ENV, DELAY_STEP_ENV, CheckpointWriter

__all__ = [
    "CHECKPOINT_LEFTOVERS",
    "DELAY_ENV",
    "DELAY_STEP_ENV",
    "IDENTITY_KEYS",
    "LATEST",
    "LEGACY_STATE_FILES",
    "NO_SPACE_ERRNOS",
    "OUTPUT_DIR_LEFTOVERS",
    "RNG_FORMAT",
    "STATE_FILE",
    "TMP_PREFIX",
    "UNIVERSAL_DIR",
    "CheckpointConfig",
    "CheckpointWriter",
    "DiskFull",
    "check_resumable",
    "check_trusted",
    "checkpoints_dir",
    "complete_checkpoints",
    "content_hash",
    "disk_usage",
    "file_hash",
    "find_resume_point",
    "free_bytes",
    "human_size",
    "is_complete",
    "is_disk_full",
    "latest_checkpoint",
    "leftovers",
    "load_rng_state",
    "no_space_message",
    "read_state",
    "remove_leftovers",
    "resume_fingerprint",
    "rng_file",
    "rng_state",
    "says_no_space",
    "seed_rng",
    "set_rng_state",
    "space_problem",
    "state_path",
]
