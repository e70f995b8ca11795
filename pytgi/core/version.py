"""pytgi's version, as its API process reports it (/info, system_fingerprint)."""

__version__ = "0.1.0"  # pyproject.toml's, kept equal by tests/unit/test_layers.py
