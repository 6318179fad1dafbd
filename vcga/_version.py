"""vcga's release (kept equal to pyproject.toml's ``version``), in a module that imports nothing, so
that core modules can name it without importing the package's ``__init__``."""

__version__ = "0.1.0"
