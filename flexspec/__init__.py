"""flexspec: the inference engine (importable without Ray)."""

__version__ = "0.1.0"
