"""hdf5 (moved to formats/hdf5/reader.py; split by responsibility next)."""

from .reader import *  # noqa: F401,F403
from .reader import vcga_formats  # noqa: F401
