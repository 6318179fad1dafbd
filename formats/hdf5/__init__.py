"""HDF5 checkpoints through h5py (installed as ``vcga.formats.hdf5``): Keras weight files and any h5py tree.

Every dataset in any group hierarchy becomes one tensor named by its path without the leading
'/' (``model_weights/dense/dense/kernel``). Chunked and compressed datasets (gzip, lzf, szip,
shuffle, fletcher32; more when the optional ``hdf5plugin`` package is installed), big-endian data
and scalar datasets read as little-endian C-order bytes, one dataset at a time (peak memory: one
tensor). The conventions for what HDF5 lacks -- bf16 and fp8 as labelled OPAQUE data, bool as
h5py's enum, complex as h5py's ``{r, i}`` compound or HDF5 2.0's native complex -- and for
attributes as metadata are specified in docs/convert.md ("HDF5 conventions").

Refused, with a :class:`~vcga.errors.VcgaFormatError` naming the dataset: strings, references,
variable-length, array and non-complex compound types, enums other than bool, null dataspaces,
and everything that would make HDF5 read another file (a converter must not wander into other
files): external links (also when a soft link leads through one), external raw storage and
virtual datasets -- each named with the file it points to, before any byte is read (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from vcga import dtypes
from vcga.contract import FormatSpec, hookimpl

from ._format import ATTR_PREFIX, DTYPE_ATTR, GROUPS_KEY, NAME, OPAQUE_DTYPES, SIGNATURE, decode_attr, encode_attr
from .reader import Hdf5Reader
from .writer import Hdf5Writer

__all__ = ["Hdf5Reader", "Hdf5Writer", "sniff", "SPEC", "encode_attr", "decode_attr",
           "GROUPS_KEY", "DTYPE_ATTR", "ATTR_PREFIX", "OPAQUE_DTYPES"]


def sniff(path: Any) -> bool:
    """The HDF5 superblock signature at 0 or at a user-block offset (512, 1024, 2048, 4096)."""
    try:
        with open(path, "rb") as f:
            for off in (0, 512, 1024, 2048, 4096):
                f.seek(off)
                if f.read(8) == SIGNATURE:
                    return True
    except OSError:
        return False
    return False


SPEC = FormatSpec(
    name=NAME,
    extensions=(".h5", ".hdf5", ".hdf", ".he5"),
    dtypes=frozenset(dtypes.EVERY),
    sniff=sniff,
    open_reader=Hdf5Reader,
    open_writer=Hdf5Writer,
    description="HDF5 through h5py: Keras weight files and any group tree; bf16/fp8 as labelled opaque data",
)


@hookimpl
def vcga_formats() -> list[FormatSpec]:
    return [SPEC]
