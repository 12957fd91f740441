"""The package's version, in a module of its own so that any layer can read it without
importing the ``anyorder`` facade (pyproject.toml carries the same string)."""

__version__ = "0.1.0"
