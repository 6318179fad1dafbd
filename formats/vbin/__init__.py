"""vendor-bin (moved to formats/vbin/reader.py; split by responsibility next)."""

from vcga.formats.vbin.reader import *  # noqa: F401,F403
from vcga.formats.vbin.reader import _FileWriter, vcga_formats, xxhash  # noqa: F401 - tests and benchmarks use these
