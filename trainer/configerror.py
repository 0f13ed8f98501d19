"""`ConfigError` and `require`, shared by every config section (kept apart to avoid import cycles)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; `key` is the dotted name the user writes (`train.max_steps`)."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)

    def under(self, section: str) -> ConfigError:
        """The same error with the key prefixed by its section (raised inside a section's __post_init__)."""
        return ConfigError(f"{section}.{self.key}" if self.key else section, self.problem)


def require(condition: bool, key: str, problem: str) -> None:
    """Raise ConfigError(key, problem) unless condition holds; used in every section's __post_init__."""
    if not condition:
        raise ConfigError(key, problem)
