"""The mixed-vendor bridge (moved to vcga/bridge/group.py; split by responsibility next)."""

from vcga.bridge.group import *  # noqa: F401,F403
from vcga.bridge.group import (  # noqa: F401 - names tests and benchmarks import from vcga.bridge
    AUTO_LARGE,
    PIPELINED_MIN_BYTES,
    combine_rows,
    group_route,
    table_digest,
)
