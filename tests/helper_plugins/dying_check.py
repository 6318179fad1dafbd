"""A conformance check plugin for runner tests (``VCGA_PLUGINS=dying_check``): ``dies`` kills
rank 1 in the middle of its second case, the way a segfaulting vendor library would."""

from __future__ import annotations

import os
from typing import Any

from vcga.contract import hookimpl


class Dies:
    name = "dies"
    description = "rank 1 exits in the middle of a case (test plugin)"
    defaults: dict[str, Any] = {}

    def run(self, ctx: Any) -> Any:
        yield ctx.run_case("first case", lambda: None)

        def second() -> None:
            if ctx.rank == 1:
                os._exit(3)

        yield ctx.run_case("second case", second)


@hookimpl
def vcga_conformance_checks() -> list[Any]:
    return [Dies()]
