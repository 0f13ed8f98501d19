"""Each rank's random generators in its checkpoint (`rng-rank<R>.pt`): written as plain numbers and
tensors, read with torch.load(weights_only=True), so the file can hold no code; and the seeding of a
rank that finds no file of its own on resume.

torch and numpy are imported inside functions: this package's config is loaded on the controller.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError
from trainer.node.checkpoint.identity import content_hash

#: Version of the RNG file layout (rng_state); older trainers pickled numpy objects instead.
RNG_FORMAT = 2


def rng_state() -> dict[str, Any]:
    """This rank's random generators as plain numbers and tensors: torch.load(weights_only=True) reads it
    back, so the file can hold no code (a pickle of numpy objects could)."""
    import numpy as np
    import torch

    python_version, python_words, python_gauss = random.getstate()
    numpy_kind, numpy_words, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "format": RNG_FORMAT,
        "python": {"version": python_version, "words": torch.tensor(python_words, dtype=torch.int64)},
        "python_gauss": python_gauss,
        "numpy": {
            "kind": numpy_kind,
            "words": torch.from_numpy(numpy_words.astype(np.int64)),
            "pos": int(numpy_pos),
            "has_gauss": int(numpy_has_gauss),
            "gauss": float(numpy_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["words"].tolist()), state["python_gauss"]))
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["words"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rng-rank{rank}.pt"


def seed_rng(seed: int, step: int, rank: int) -> None:
    """Seed this rank's generators for a resume at `step` when the checkpoint has no random state for
    it: it was written by fewer processes (a job restarted on more nodes), or the file was deleted.
    From (train.seed, step, rank): each such rank its own streams, the same on every resume from this
    step, and not the ones step 1 started with (seed + rank), which would repeat their dropout masks."""
    import numpy as np
    import torch

    value = int(content_hash(f"rng:{seed}:{step}:{rank}")[:8], 16)  # 32 bits: numpy's limit
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every CUDA device too


def load_rng_state(path: Path) -> dict[str, Any]:
    """A rank's RNG file, read with torch.load(weights_only=True): no code in it can run. ConfigError
    naming the file for anything else (a pickle of objects, an older trainer's format, a damaged file)."""
    import torch

    try:
        state = torch.load(path, weights_only=True)
    except Exception as err:  # whatever is wrong with the file, the answer is the same
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a random-state file this trainer wrote (it may hold code: not loaded; "
            f"{type(err).__name__}); delete it to resume without its random streams, or start over "
            "with checkpoint.resume=never",
        ) from None
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        raise ConfigError(
            "checkpoint.resume",
            f"{path} is not a random-state file this trainer wrote (format {RNG_FORMAT}); delete it to "
            "resume without its random streams, or start over with checkpoint.resume=never",
        )
    return state
