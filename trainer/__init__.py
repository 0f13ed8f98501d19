"""clustertrain: provision a multi-node training cluster and run a bundled distributed trainer."""

__version__ = "0.1.0"
