"""FAKE torch_mlu/mlu/cncl.py: ``version()`` and the ``cncl`` backend registration, as the real file."""

import torch

import torch_mlu


def version():
    major, minor, patch = torch_mlu._MLUC._cncl_version()
    return (major, minor, patch)


def is_cncl_available():
    return True


if not hasattr(torch.distributed.Backend, "CNCL"):
    torch.distributed.Backend.register_backend(
        "cncl",
        lambda store, group_rank, group_size, timeout: torch_mlu._MLUC.ProcessGroupCNCL(
            store, group_rank, group_size, timeout
        ),
        devices=["mlu"],
    )
