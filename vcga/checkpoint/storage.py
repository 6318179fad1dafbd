"""DCP storage for VCGA checkpoints: per-rank vendor-bin shards, checksummed, published atomically.

:class:`VcgaStorageWriter` and :class:`VcgaStorageReader` plug into torch.distributed.checkpoint
(DCP), which does the planning -- which rank writes which chunk, and which rank reads what on a
different world size (resharding) -- while VCGA decides how bytes reach the disk:

- each rank writes its chunks into one vendor-bin file (``__<rank>_0.vbin``: XXH3-64 per tensor,
  page-aligned, mappable) inside a hidden directory ``.step-<N>.tmp-<token>`` that rank 0 creates
  while planning; the file is fsynced and renamed into place before the rank reports done;
- rank 0, once every rank reported (DCP gathers the results), writes DCP's ``.metadata`` -- in
  which every chunk's entry pins its file, tensor and checksum (:class:`~vcga.checkpoint.dcpmeta.VbinItem`)
  -- and a manifest pinning ``.metadata``'s checksum and every file's size; then renames the
  directory to ``step-<N>``, fsyncs the root and writes ``latest`` (atomically, checksummed): the
  checkpoint is published last, when everything it names is durable. Older checkpoints beyond
  ``keep_last`` are removed after that.

The reader verifies every file it opens -- every tensor checksum and every padding byte, so a
flipped bit anywhere in a shard is an error naming the file and the tensor -- in one sequential
pass of reads straight into the destination tensors (through a buffer where a chunk does not fill
one), handing each to DCP once its own checksum matched; a damaged byte fails the load before it
returns.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from vcga import dtypes, tensors
from vcga.atomic import atomic_write_bytes, fsync_dir
from vcga.contract import TensorEntry
from vcga.errors import VcgaChecksumError, VcgaError, VcgaFormatError

from .dcpmeta import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    METADATA_FILE,
    VbinItem,
    dump_manifest,
    load_manifest,
    load_metadata,
    metadata_checksum,
)
from .shard_writer import write_shard

__all__ = ["VcgaStorageWriter", "VcgaStorageReader", "SafeLoadPlanner", "LATEST_FILE", "step_dir",
           "read_latest", "complete_steps"]

log = logging.getLogger("vcga.checkpoint")

DATA_FORMAT = "vendor-bin"
LATEST_FILE = "latest"
LATEST_FORMAT = "vcga-checkpoint-latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STALE = re.compile(r"^\.step-\d+\.(tmp|old)-[0-9a-f]+$")


def step_dir(step: int) -> str:
    return f"step-{step}"


def _data_format() -> Any:
    """The vendor-bin format, through the plugin manager (the core never imports a plugin module)."""
    from vcga.convert import format_by_name

    return format_by_name(DATA_FORMAT)


def _item_name(index: MetadataIndex) -> str:
    """The tensor name of a write item inside its vendor-bin file: the fqn, and where the chunk
    starts when it is not the whole tensor (one rank can hold several chunks of one tensor)."""
    offset = index.offset
    if offset is None or not any(offset):
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in offset)}"


@dataclass(frozen=True)
class _RankFile:
    """What rank 0 tells each rank while planning: the directory and the file to write."""

    directory: str
    file: str


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


class VcgaStorageWriter(StorageWriter):
    """Writes one checkpoint ``root/step-<step>`` (see the module docstring).

    :param root: the checkpoint root (shared by every rank: a shared filesystem on several nodes).
    :param step: the training step the checkpoint holds.
    :param keep_last: checkpoints to keep after publishing this one (None: keep all).
    :param on_rank_written: called on every rank once its shard is durable, before the checkpoint is
        published (where :mod:`vcga.testing.fault` injects "a rank killed during save").
    :param shard_writer: writes this rank's entries as one vendor-bin file and returns each
        tensor's (checksum, nbytes) -- :func:`~vcga.checkpoint.shard_writer.write_shard` in this
        process by default; async_save's writer process otherwise.
    :param before_write: called before this rank writes anything; what it raises fails the save
        on every rank (async_save: the state changed while it was being staged).
    """

    def __init__(self, root: str | os.PathLike[str], step: int, *, keep_last: int | None = 2,
                 on_rank_written: Callable[[], None] | None = None,
                 shard_writer: Callable[[Path, dict[str, str], list[TensorEntry]], dict[str, tuple[str, int]]]
                 | None = None, before_write: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.shard_writer = shard_writer
        self.before_write = before_write
        self.root = Path(root)
        self.step = step
        self.keep_last = keep_last
        self.on_rank_written = on_rank_written
        self.rank = 0
        self.is_coordinator = False
        self.save_id = secrets.token_hex(8)
        self.tmp_dir: Path | None = None  # rank 0: the directory this save writes into

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.save_id = secrets.token_hex(8)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.root / step_dir(self.step)), save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Rank 0 names and creates this save's private directory before any rank writes: a unique
        # name per save, so files of an interrupted save (same step, earlier attempt) never mix in.
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = self.root / f".step-{self.step}.tmp-{self.save_id}"
        self.tmp_dir.mkdir()
        return [dataclasses.replace(p, storage_data=_RankFile(self.tmp_dir.name, f"__{i}_0.vbin"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.before_write is not None:
            self.before_write()  # raising here fails the save on every rank (DCP gathers it)
        target: _RankFile = plan.storage_data
        path = self.root / target.directory / target.file
        names: list[tuple[Any, str]] = []
        if plan.items:
            entries = []
            for item in plan.items:
                name = _item_name(item.index)
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:  # DCP's contract: a BYTE_IO item resolves to BytesIO
                    buf = cast(io.BytesIO, data).getbuffer()
                    entries.append(TensorEntry(name, "uint8", (buf.nbytes,), buf, {"dcp.type": "bytes"}))
                else:
                    # A device tensor comes to the host through its vendor plugin; a
                    # non-contiguous one is packed once. Contiguous host memory is not copied.
                    entries.append(tensors.from_torch(name, cast(torch.Tensor, data).detach()))
                names.append((item, name))
            metadata = {"vcga.checkpoint.step": str(self.step), "vcga.checkpoint.rank": str(self.rank)}
            # The file is fsynced and in place. Its index holds each tensor's checksum, read back
            # (the index only, no tensor bytes) so .metadata can pin them.
            stored = (self.shard_writer or write_shard)(path, metadata, entries)
        results = []
        for item, name in names:
            checksum, nbytes = stored[name]
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes,
                                       storage_data=VbinItem(target.file, name, nbytes, checksum)))
        if self.on_rank_written is not None:
            self.on_rank_written()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0, after every rank's shard is durable: metadata, manifest, then publish."""
        assert self.tmp_dir is not None, "finish() runs on the coordinator after prepare_global_plan()"
        metadata.storage_data = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        raw = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        # Plain writes: the directory is private to this save until it is renamed, so nothing can
        # see a half-written file; each is fsynced, then the directory once.
        _write_synced(self.tmp_dir / METADATA_FILE, raw)
        files = sorted({wr.storage_data.relative_path for rank_results in results for wr in rank_results})
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "step": self.step,
            "world_size": len(results),
            "data_format": DATA_FORMAT,
            "metadata": {"file": METADATA_FILE, "size": len(raw), "checksum": metadata_checksum(raw)},
            "files": [{"file": f, "size": (self.tmp_dir / f).stat().st_size} for f in files],
            "save_id": self.save_id,
        }
        _write_synced(self.tmp_dir / MANIFEST_FILE, dump_manifest(manifest))
        fsync_dir(self.tmp_dir)
        publish(self.root, self.step, self.tmp_dir, keep_last=self.keep_last)

    def abort(self) -> None:
        """Rank 0, when the save failed: remove this save's directory (nothing was published)."""
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # used explicitly, never picked by DCP's storage auto-detection


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(root: Path, step: int, tmp_dir: Path, *, keep_last: int | None) -> None:
    """Rename ``tmp_dir`` to ``root/step-<step>``, then point ``latest`` at it, then prune."""
    final = root / step_dir(step)
    aside = None
    if final.exists():
        # This step was saved before (training restarted from an earlier checkpoint and came
        # back here): the new one replaces it. Until `latest` is rewritten it may name neither;
        # load_latest then falls back to the newest complete one below it.
        aside = root / f".step-{step}.old-{secrets.token_hex(8)}"
        os.rename(final, aside)
    os.rename(tmp_dir, final)
    fsync_dir(root)
    write_latest(root, step)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    prune(root, keep_last, latest=step)


def write_latest(root: Path, step: int) -> None:
    doc = {"format": LATEST_FORMAT, "step": step, "dir": step_dir(step)}
    # The same checked JSON as the manifest: a flipped bit cannot silently name another step.
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    from .dcpmeta import _checksum

    atomic_write_bytes(root / LATEST_FILE, json.dumps({**doc, "checksum": _checksum(body)},
                                                      sort_keys=True, separators=(",", ":")).encode() + b"\n")


def read_latest(root: Path) -> int | None:
    """The step ``root/latest`` names; None when there is no such file.

    :raises VcgaFormatError: the file is damaged."""
    path = Path(root) / LATEST_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    from .dcpmeta import _checksum

    try:
        doc = json.loads(data.decode("ascii"))
        stored = doc.pop("checksum")
        body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        ok = (doc.get("format") == LATEST_FORMAT and stored == _checksum(body) and type(doc.get("step")) is int
              and doc.get("dir") == step_dir(doc["step"]))
    except (ValueError, UnicodeDecodeError, KeyError, AttributeError, TypeError):
        ok = False
    if not ok:
        raise VcgaFormatError(path, "is damaged (not the checked JSON VCGA writes)")
    return int(doc["step"])


def complete_steps(root: Path) -> list[int]:
    """Steps with a ``step-<N>`` directory holding a manifest (renamed into place only when
    complete), newest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and (Path(root) / name / MANIFEST_FILE).is_file():
            out.append(int(m.group(1)))
    return sorted(out, reverse=True)


def prune(root: Path, keep_last: int | None, *, latest: int) -> None:
    """Remove checkpoints beyond the newest ``keep_last`` up to ``latest``, checkpoints newer than
    ``latest`` (from an abandoned timeline: training restarted from an earlier one), and leftovers of
    interrupted saves. Only rank 0 calls it, after publishing, with no other save in flight."""
    steps = complete_steps(root)
    keep = [s for s in steps if s <= latest]
    if keep_last is not None:
        keep = keep[:max(1, keep_last)]
    doomed = [step_dir(s) for s in steps if s not in keep]
    doomed += [name for name in os.listdir(root) if _STALE.match(name)
               or (_STEP_DIR.match(name) and not (root / name / MANIFEST_FILE).exists())]
    for name in doomed:
        shutil.rmtree(root / name, ignore_errors=True)
    if doomed:
        fsync_dir(root)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


class VcgaStorageReader(StorageReader):
    """Reads one VCGA checkpoint directory (``root/step-<N>``) for DCP's ``load``.

    :param verify: check every tensor's checksum and padding byte (default; :func:`load_latest`
        always does). ``False`` only for comparisons at equal work with readers that check nothing
        (benchmarks/recovery.py against torch's ``FileSystemReader``); the manifest and metadata
        checksums are checked either way."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.verify = verify
        self.storage_data: dict[MetadataIndex, VbinItem] = {}
        self.manifest: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.storage_data = {}

    def read_metadata(self) -> Metadata:
        mpath = self.path / MANIFEST_FILE
        try:
            self.manifest = load_manifest(mpath.read_bytes(), mpath)
            raw = (self.path / METADATA_FILE).read_bytes()
        except FileNotFoundError as e:
            raise VcgaFormatError(e.filename, "is missing; the checkpoint is incomplete") from None
        got = metadata_checksum(raw)
        if got != self.manifest["metadata"]["checksum"]:
            raise VcgaChecksumError(self.path / METADATA_FILE, f"checksum mismatch (computed {got}); the file was "
                                    "damaged after it was written", expected=self.manifest["metadata"]["checksum"])
        for f in self.manifest["files"]:
            p = self.path / f["file"]
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise VcgaFormatError(p, "is missing; the checkpoint is incomplete") from None
            if size != f["size"]:
                raise VcgaFormatError(p, f"is {size} bytes where the manifest says {f['size']}; it was truncated or "
                                      "replaced")
        md = load_metadata(raw, classes="torch", where=self.path / METADATA_FILE)
        for idx, loc in md.storage_data.items():
            if not isinstance(loc, VbinItem):
                raise VcgaFormatError(self.path / METADATA_FILE, f"{idx.fqn!r} is not stored in a vendor-bin file")
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        per_file: dict[str, dict[str, list[ReadItem]]] = {}
        for req in plan.items:
            loc = self.storage_data[req.storage_index]
            per_file.setdefault(loc.relative_path, {}).setdefault(loc.name, []).append(req)
        spec = _data_format()
        for name, by_tensor in per_file.items():
            path = self.path / name
            with spec.open_reader(path, verify=self.verify) as reader:
                stored = {e.name: e for e in reader.index()}
                for tname, reqs in by_tensor.items():
                    pinned = self.storage_data[reqs[0].storage_index].checksum
                    if tname not in stored:
                        raise VcgaFormatError(path, f"has no tensor {tname!r}, which the metadata places there")
                    if stored[tname].checksum != pinned:
                        raise VcgaChecksumError(path, f"tensor {tname!r}: the file stores checksum "
                                                f"{stored[tname].checksum} where .metadata pins another; the file "
                                                "belongs to another checkpoint", expected=pinned)
                # A chunk that fills its whole destination, a contiguous CPU tensor of the stored
                # dtype, is read straight into the destination's memory: no copy, and no page
                # faults of a cold mapping (docs/vendor-bin.md, "Piece sizes and access patterns").
                into: dict[str, memoryview] = {}
                direct: dict[str, tuple[ReadItem, torch.Tensor]] = {}
                for tname, reqs in by_tensor.items():
                    dst_bytes = _direct_destination(reqs, stored[tname], planner)
                    if dst_bytes is not None:
                        into[tname], direct[tname] = dst_bytes[0], (reqs[0], dst_bytes[1])
                # Every tensor's checksum and every padding byte of the file, in one sequential
                # pass of reads, each tensor handed over as soon as its own checksum is verified.
                # A damaged byte anywhere raises before read_data returns (a destination read into
                # directly then holds the damaged bytes, never committed), which fails this
                # checkpoint's load on every rank (DCP gathers the errors) and load_latest moves
                # on to the previous one, which rewrites every tensor: no rank continues from a mix.
                for entry in reader.read_in_order(verify=self.verify, into=into, wanted=by_tensor.keys()):
                    if entry.name in direct:
                        req, dst = direct[entry.name]
                        planner.commit_tensor(req, dst)
                        continue
                    for req in by_tensor[entry.name]:
                        if req.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(req, io.BytesIO(bytes(memoryview(entry.data))))
                            continue
                        src = narrow_tensor_by_index(tensors.to_torch(entry), req.storage_offsets, req.lengths)
                        dst = planner.resolve_tensor(req).detach()
                        if dst.size() != src.size():
                            raise VcgaFormatError(path, f"tensor {entry.name!r}: chunk of shape {list(src.size())} "
                                                  f"for a destination of shape {list(dst.size())}")
                        dst.copy_(src)
                        planner.commit_tensor(req, dst)
                        del src
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _direct_destination(reqs: list[ReadItem], stored: TensorEntry,
                        planner: LoadPlanner) -> tuple[memoryview, torch.Tensor] | None:
    """The destination's memory as a writable byte buffer when one request reads the whole stored
    tensor into a plain contiguous CPU tensor of its dtype and shape; else None (the chunk is then
    read into a buffer and copied: resharding, another dtype or device, byte values)."""
    if len(reqs) != 1 or reqs[0].type != LoadItemType.TENSOR:
        return None
    req = reqs[0]
    if any(req.storage_offsets) or tuple(req.lengths) != tuple(stored.shape):
        return None
    try:
        stored_dtype = dtypes.to_torch(stored.dtype)
    except (AttributeError, VcgaError):  # a dtype this torch lacks: the copy path says so
        return None
    dst = planner.resolve_tensor(req).detach()
    if (type(dst) is not torch.Tensor or dst.device.type != "cpu" or not dst.is_contiguous()
            or dst.is_conj() or dst.is_neg() or dst.dtype != stored_dtype
            or tuple(dst.shape) != tuple(stored.shape) or dst.numel() == 0):
        return None
    return tensors.byte_view(dst.reshape(-1).view(torch.uint8).numpy()), dst


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are unpickled with
    ``torch.load(weights_only=True)``: DCP's own planner uses ``weights_only=False`` -- whatever
    the checkpoint's pickle names would run. Checksums prove the bytes are the ones written, not
    who wrote them."""

    def create_local_plan(self) -> Any:
        # A rank's own entry that the checkpoint lacks -- vcga.compress's state of a rank that a
        # smaller world did not have -- is left as the template it is: its owner starts afresh
        # (CompressionState.load_state_dict). Any other missing key still fails the load.
        from vcga.compress.hook import STATE_KEY_PREFIX

        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        for fqn in [k for k in self.state_dict if k not in saved and k.rpartition(".")[2].startswith(STATE_KEY_PREFIX)]:
            del self.state_dict[fqn]
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
