"""torchft on backend ``vcga``: a replica group that dies is healed without restarting the job.

torchft's ``Manager`` reconfigures its process group on every quorum change (a replica group left
or joined) through ``configure(store_addr, replica_id, rank, world_size, ...)``; torchft ships such
reconfigurable groups for NCCL and gloo only. :class:`ProcessGroupVcga` is one for ``vcga``: each
reconfiguration creates a fresh ``vcga`` group over the quorum's store, so the replicas of a
quorum may run different vendors (each replica's backend: ``VCGA_BACKEND`` or the best
available), and VCGA bridges them::

    from torchft import Manager
    from vcga.integrations.torchft import ProcessGroupVcga

    manager = Manager(pg=ProcessGroupVcga(), min_replica_size=1, ...)

Replica groups, not ranks, come and go under torchft, so a simulated vendor is set per replica
process (``VCGA_BACKEND=sim-hccl``) rather than by ``VCGA_SIM_VENDORS`` (whose layout is by rank
in a fixed world size).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torchft.process_group import ProcessGroupWrapper

__all__ = ["ProcessGroupVcga"]


class ProcessGroupVcga(ProcessGroupWrapper):
    """A reconfigurable ``vcga`` process group for torchft's ``Manager``.

    :param timeout: every collective's timeout (and the store's), as torchft's groups take it.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        import torch.distributed as dist

        import vcga  # noqa: F401 - registers the backend
        from vcga.process_group import create_process_group

        opts = dist.distributed_c10d._DistributedBackendOptions()
        opts.store = store
        opts.group_rank = rank
        opts.group_size = world_size
        opts.timeout = self._timeout
        opts.group_id = f"torchft_vcga_{self._quorum_id}"
        opts.global_ranks_in_group = list(range(world_size))
        return create_process_group(opts)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "torchft-vcga"
