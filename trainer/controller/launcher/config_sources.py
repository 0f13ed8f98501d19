"""Where each value of the bundled trainer's config comes from, by one precedence rule.

    trainer default < inventory group_vars < the config file < --set < --engine

The more explicit wins: the inventory's training_engine, training_zero_stage, cluster_data_path,
cluster_nccl_timeout_s and training_health_webhook_url are the cluster's defaults, a config file
(`--config FILE`, else the inventory's `training_config`) is a choice for this job, a `--set` or
`--engine` on the command line a choice for this launch. An inventory value is therefore passed to
the trainer's loader only for a key the config file does not set, and every value shows its source;
where a lower layer set a key to something else, the plan and the launch say so in one line
(`distributed.engine: deepspeed from --set (your --config file says ddp)`), so a value is never
overridden silently. make_plan builds the layers and loads the config with the trainer's own loader
(trainer.node.config.load_config); this module only decides the order and the story.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.redaction import REDACTED, SECRET_KEYS, redact_urls

DEFAULT = "trainer default"
SET = "--set"
ENGINE = "--engine"

#: What will train, as the plan shows it (label, dotted key): the bundled trainer's rows.
WHAT_TRAINS = (
    ("model", "model.name_or_path"),
    ("data", "data.path"),
    ("LoRA", "lora.enabled"),
    ("LoRA rank", "lora.r"),
    ("steps", "train.max_steps"),
    ("epochs", "train.num_epochs"),
    ("engine", "distributed.engine"),
    ("ZeRO stage", "distributed.zero_stage"),
)


@dataclass(frozen=True)
class Sourced:
    """One config value in effect, the layer it came from, and the lower layer it overruled."""

    value: Any
    source: str
    overruled: str = ""
    """'' or what a lower layer said instead, e.g. "your --config file says ddp"."""

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "overruled": self.overruled or None}


@dataclass(frozen=True)
class Layers:
    """The layers under the trainer's defaults, lowest first (see the module's rule)."""

    inventory: Mapping[str, tuple[str, Any]]
    """Dotted key -> (the inventory variable, its value)."""
    file_label: str = "--config"
    """How the user named the file: --config, or training_config (the inventory's)."""
    file_values: Mapping[str, Any] = field(default_factory=dict)
    """Dotted key -> the value the config file sets (read_file_values)."""
    sets: Sequence[str] = ()
    """The user's --set KEY=VALUE list, in order."""
    engine: str | None = None

    def _set_values(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for item in self.sets:
            key, _, value = item.partition("=")
            values[key.strip()] = value.strip()  # the last --set of a key wins, as in the loader
        return values

    def overrides(self) -> list[str]:
        """The --set list for load_config(the config file, ...): the inventory's values that neither the
        file nor the command line sets, then the user's --set, then --engine."""
        explicit = self._set_values()
        if self.engine:
            explicit["distributed.engine"] = self.engine
        derived = [
            f"{key}={value}"
            for key, (_, value) in self.inventory.items()
            if key not in self.file_values and key not in explicit
        ]
        return [*derived, *self.sets, *([f"distributed.engine={self.engine}"] if self.engine else [])]

    def sources(self, resolved: Mapping[str, Any]) -> dict[str, Sourced]:
        """Dotted key -> its value in `resolved` (the loaded config, redacted) and its source: the
        WHAT_TRAINS keys always, and every other key a layer set."""
        sets = self._set_values()
        file_source = f"{self.file_label} file"  # its path is the plan's "trainer config"
        file_says = f"{'your' if self.file_label == '--config' else 'the'} {self.file_label} file says"
        keys = dict.fromkeys([*(key for _, key in WHAT_TRAINS), *self.inventory, *self.file_values, *sets])
        keys.pop("output_dir", None)  # the launcher's, from --run-name: not a choice to explain
        out: dict[str, Sourced] = {}
        for key in keys:
            # Lowest first: each layer that sets the key, with what it said.
            said: list[tuple[str, Any, str]] = []  # (source, value, how to name it when overruled)
            if key in self.inventory:
                var, value = self.inventory[key]
                said.append((f"inventory group_vars ({var})", value, f"the inventory's {var} says"))
            if key in self.file_values:
                said.append((file_source, self.file_values[key], file_says))
            if key in sets:
                said.append((SET, sets[key], "--set says"))
            if key == "distributed.engine" and self.engine:
                said.append((ENGINE, self.engine, "--engine says"))
            value = _lookup(resolved, key)
            if isinstance(value, Mapping):
                continue  # a section the file leaves empty (`lora:`), not a value
            if not said:
                out[key] = Sourced(value, DEFAULT)
                continue
            source = said[-1][0]
            lower = [(shown, v) for _, v, shown in said[:-1] if _text(v) != _text(value)]
            overruled = f"{lower[-1][0]} {shown_value(key, lower[-1][1])}" if lower else ""
            out[key] = Sourced(value, source, overruled)
        return out


def read_file_values(path: Path | None) -> dict[str, Any]:
    """Dotted key -> value for every value a trainer YAML file sets ({} when it cannot be read: the
    trainer's loader then reports why, naming the file)."""
    import yaml

    if path is None:
        return {}
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    values: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        # Sections are mappings; no config value is one (the loader refuses a mapping as a value).
        for name, value in node.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict):
                walk(value, f"{key}.")
            else:
                values[key] = value

    if isinstance(tree, dict):
        walk(tree, "")
    return values


def shown_value(key: str, value: Any) -> str:
    """A value as the plan prints it: secrets redacted (a credential inside a URL too), '' named."""
    if key in SECRET_KEYS and value not in (None, ""):
        return REDACTED
    return "''" if value == "" else str(redact_urls(value))


def rows(sources: Mapping[str, Sourced]) -> list[tuple[str, str]]:
    """The plan's "what will train" rows: (label, "value (source)")."""

    def row(label: str, key: str, text: str | None = None) -> tuple[str, str]:
        item = sources[key]
        return label, f"{shown_value(key, item.value) if text is None else text} ({item.source})"

    model = sources["model.name_or_path"].value
    data = sources["data.path"].value
    lora = sources["lora.enabled"].value
    engine = sources["distributed.engine"].value
    out = [
        row("model", "model.name_or_path", None if model else "the built-in tiny GPT"),
        row("data", "data.path", None if data else "the bundled English text"),
        row("LoRA", "lora.enabled", "on" if lora else "off"),
    ]
    if lora:
        out.append(row("LoRA rank", "lora.r"))
    if sources["train.max_steps"].value is None and sources["train.num_epochs"].value is not None:
        epochs = sources["train.num_epochs"].value
        derived = f"{epochs:g} epoch(s), derived on the nodes from the data"
        out.append(row("steps", "train.num_epochs", derived))
    else:
        out.append(row("steps", "train.max_steps"))
    out.append(row("engine", "distributed.engine"))
    if engine == "deepspeed":
        out.append(row("ZeRO stage", "distributed.zero_stage"))
    return out


def notes(sources: Mapping[str, Sourced]) -> list[str]:
    """One line per value that overruled a lower layer, e.g.
    `distributed.engine: deepspeed from --set (your --config file says ddp)`."""
    return [
        f"{key}: {shown_value(key, s.value)} from {s.source} ({s.overruled})"
        for key, s in sources.items()
        if s.overruled
    ]


def _lookup(config: Mapping[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _text(value: Any) -> str:
    """A layer's value and the loaded one compared as text: --set gives `2`, the config 2."""
    if isinstance(value, bool):
        return str(value).lower()
    return "" if value is None else str(value).strip()
