"""Checksums of every tensor a checkpoint of ours holds, checked when it is read.

A checkpoint with a few bytes flipped inside a weight (a bad disk, a copy gone wrong) loads
and trains on under plain Lightning: nothing in torch's format notices.  Ours carry a fast
hash of each tensor's bytes (xxHash's XXH3, from the maintained ``xxhash`` package: several
GB/s a core), by the tensor's path in what was saved (``state_dict/net.0.weight``,
``optimizer_states/0/state/net.0.weight/exp_avg``, ...):

- a file we write with ``torch.save`` (a single-file checkpoint, a ZeRO directory's main
  file and shard files, ``consolidate``'s output) holds them in a record of its own,
  :data:`RECORD`, beside torch's (the file is a zip archive; ``torch.load`` reads only its
  own records), appended once torch has written its part; the hashing runs on two threads
  while the disk takes torch's bytes (:func:`save_checksummed`;
  ``benchmarks/checkpoint_checksums.py``);
- a distributed checkpoint (FSDP) holds a file of the same name beside its shards, the digest of every
  stored item's bytes in the ``.distcp`` files and of ``meta.pt``
  (:func:`write_distributed_checksums`, by rank 0 once every rank has written).

Reading checks them before anything is loaded into a model or optimizer
(:func:`verify_file`, :func:`verify_distributed`): a mismatch is a
:class:`ChecksumMismatchError` naming the tensor and the file.  A checkpoint without
checksums (Lightning's own, an older one) is read as it is.  Checking can be turned off
with the environment variable ``LIGHTNING_FASTOPT_CHECKSUMS=0`` (they are still written).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch
import xxhash

from lightning_fastopt.checkpoint.errors import BrokenCheckpointError

# where they are: a record of a torch.save zip archive, and the file beside a distributed checkpoint's shards
RECORD = "fastopt_checksums.json"
ALGORITHM = "xxh3_64"
SWITCH = "LIGHTNING_FASTOPT_CHECKSUMS"  # "0": not checked at load
HASHING_THREADS = 2  # while the disk takes torch's bytes


class ChecksumMismatchError(BrokenCheckpointError):
    """A tensor of a checkpoint does not hold the bytes it was saved with."""


def checking() -> bool:
    """Whether checksums are checked at load (the environment's :data:`SWITCH`)."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def digest(data) -> str:
    """The checksum of a bytes-like object."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_digest(tensor: torch.Tensor) -> str:
    """The checksum of a tensor's bytes (its dtype's, in row-major order)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return digest(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every plain (strided, materialized) tensor inside ``obj`` (dicts, lists, tuples),
    with its path of keys joined by ``/``."""
    if isinstance(obj, torch.Tensor):
        if obj.layout is torch.strided and obj.device.type != "meta" and not obj.is_quantized:
            yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{path}/{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{path}/{i}" if path else str(i))


def digests(obj: Any, threads: int = 1) -> dict[str, str]:
    """The checksum of every tensor inside ``obj``, by its path (on ``threads`` threads:
    the hashing releases the interpreter's lock)."""
    found = list(_tensors(obj))
    if threads <= 1 or len(found) < 2:
        return {path: tensor_digest(t) for path, t in found}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastopt-checksums") as pool:
        return dict(zip((path for path, _ in found), pool.map(tensor_digest, (t for _, t in found))))


def save_checksummed(obj: Any, f: IO[bytes]) -> None:
    """``torch.save(obj, f)`` into ``f`` (a new file opened for reading and writing), then
    the checksums of ``obj``'s tensors appended to it as :data:`RECORD`.  The hashing runs
    while the disk takes torch's bytes (flushed on a thread meanwhile: both release the
    interpreter's lock), then the record appended; the caller flushes what the append wrote.
    What is not torch's zip archive (a ``torch.save`` a test stood in for) gets none."""
    torch.save(obj, f)
    f.flush()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastopt-checksums") as flushing:
        synced = flushing.submit(_fsync, f.fileno())
        tensors = digests(obj, threads=HASHING_THREADS)
        synced.result()
    f.seek(0)
    if not zipfile.is_zipfile(f):  # not torch's zip archive (a torch.save stood in for, the legacy format)
        f.seek(0, os.SEEK_END)
        return
    f.seek(0)
    with zipfile.ZipFile(f, mode="a") as archive:
        names = archive.namelist()
        if names:  # torch's records are under one folder
            archive.writestr(f"{names[0].split('/', 1)[0]}/{RECORD}",
                             json.dumps({"algorithm": ALGORITHM, "tensors": tensors}))


def _fsync(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass  # the caller's own flush, after the append, raises what the disk says


def saved_checksums(path) -> dict[str, str] | None:
    """The checksums a file written by :func:`save_checksummed` holds (None: it holds none,
    or it is not a zip archive)."""
    if not zipfile.is_zipfile(path):
        return None  # torch's legacy format (or no torch file: its load says so)
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith(f"/{RECORD}")), None)
            if name is None:
                return None
            record = json.loads(archive.read(name))
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise ChecksumMismatchError(f"cannot read the checksums of {os.fspath(path)}: {err} ({SWITCH}=0 loads it "
                                    "unchecked)") from err
    if not (isinstance(record, dict) and record.get("algorithm") == ALGORITHM and isinstance(record.get("tensors"),
                                                                                              dict)):
        raise ChecksumMismatchError(f"cannot check {os.fspath(path)}: its checksums are not in a form this version of "
                                    f"lightning_fastopt reads ({SWITCH}=0 loads it unchecked)")
    return record["tensors"]


def verify_file(loaded: Any, path, where: str) -> None:
    """Check ``loaded`` (what ``torch.load`` read from ``path``) against the checksums the
    file holds, where it holds any and the switch is on: :class:`ChecksumMismatchError`
    naming (in ``where``'s words) the first tensor that does not match."""
    if not checking():
        return
    expected = saved_checksums(path)
    if expected is None:
        return
    found = dict(_tensors(loaded))
    for name, value in expected.items():
        tensor = found.get(name)
        if tensor is None:
            raise ChecksumMismatchError(f"{where} is damaged: the tensor {name} it was saved with is missing")
        if tensor_digest(tensor) != value:
            raise ChecksumMismatchError(_differs(f"{where} is damaged: the tensor {name} ({_shape(tensor)})"))
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ChecksumMismatchError(f"{where} is damaged: it holds tensors it was not saved with "
                                    f"({', '.join(extra[:5])})")


def _differs(what: str) -> str:
    """The message of ``what`` (a file, a tensor in it) whose checksum differs."""
    return (f"{what} does not hold the bytes it was saved with (its checksum differs): a disk or a copy changed the "
            f"file; load an earlier checkpoint, or set {SWITCH}=0 to load it anyway")


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)}, {str(tensor.dtype).removeprefix('torch.')}"


# ---------------------------------------------------------------- distributed checkpoints
def _stored_items(directory: str) -> Iterator[tuple[str, str, int, int]]:
    """Each stored item of the distributed checkpoint in ``directory``: its name (the
    tensor's fully qualified name, with the chunk's offsets where it is one piece of it),
    its file, offset and length."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return  # no tensors stored (a writer that wrote none)
    metadata = FileSystemReader(directory).read_metadata()
    for index, info in metadata.storage_data.items():
        name = index.fqn + (f"{list(index.offset)}" if index.offset is not None else "")
        yield name, info.relative_path, info.offset, info.length


def _range_digest(directory: str, relative_path: str, offset: int, length: int) -> str:
    with open(os.path.join(directory, relative_path), "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        return ""  # cut short: never the digest of whole bytes
    return digest(data)


def _whole_file_digest(path: str) -> str:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * 2**20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def write_distributed_checksums(directory: str, side_files: tuple[str, ...] = ()) -> None:
    """Write :data:`RECORD` into a distributed checkpoint every rank has written:
    the digest of each stored item's bytes, and of each of ``side_files`` present."""
    items = [[name, path, offset, length, _range_digest(directory, path, offset, length)]
             for name, path, offset, length in _stored_items(directory)]
    files = {name: _whole_file_digest(os.path.join(directory, name)) for name in side_files
             if os.path.isfile(os.path.join(directory, name))}
    record = {"algorithm": ALGORITHM, "items": items, "files": files}
    with open(os.path.join(directory, RECORD), "wb") as f:  # (flushed with the directory: save_staged)
        f.write(json.dumps(record).encode())
        f.flush()
        os.fsync(f.fileno())


def verify_distributed(directory) -> None:
    """Check a distributed checkpoint against its :data:`RECORD` (where it has one
    and the switch is on): :class:`ChecksumMismatchError` naming the tensor (or side file)
    and the file that does not match."""
    directory = os.fspath(directory)
    record_path = os.path.join(directory, RECORD)
    if not checking() or not os.path.isfile(record_path):
        return
    try:
        with open(record_path) as f:
            record = json.load(f)
        items, files = record["items"], record["files"]
        assert record["algorithm"] == ALGORITHM
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        raise ChecksumMismatchError(f"cannot read {record_path}, the checksums of the checkpoint {directory}: {err} "
                                    f"({SWITCH}=0 loads it unchecked)") from err
    for name, value in files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or _whole_file_digest(path) != value:
            raise ChecksumMismatchError(_differs(f"{path} is damaged: it"))
    for name, relative_path, offset, length, value in items:
        if _range_digest(directory, relative_path, offset, length) != value:
            raise ChecksumMismatchError(_differs(f"{os.path.join(directory, relative_path)} is damaged: the tensor "
                                                 f"{name} (bytes {offset}..{offset + length})"))


def checksum_staged(staging: str) -> None:
    """What the FSDP strategies do to a staged checkpoint once every rank has written it
    (``save_staged``'s ``before_move``): a distributed one (a directory) gets its checksums,
    of torch's stored items and of the files beside them whole (Lightning's ``meta.pt``)."""
    if os.path.isdir(staging):  # the files beside torch's (Lightning's meta.pt) whole
        side = tuple(n for n in sorted(os.listdir(staging)) if not (n == ".metadata" or n.endswith(".distcp")
                                                                     or n == RECORD))
        write_distributed_checksums(staging, side)


def verify_distributed_once(directory, ranks) -> None:
    """:func:`verify_distributed` read by rank 0 alone (it reads every byte), its verdict
    broadcast: every rank raises the same :class:`ChecksumMismatchError`, or none does.
    ``ranks``: ``is_global_zero`` and ``broadcast``, as a Lightning strategy has them."""
    problem = None
    if ranks.is_global_zero:
        try:
            verify_distributed(directory)
        except ChecksumMismatchError as err:
            problem = str(err)
    problem = ranks.broadcast(problem)
    if problem is not None:
        raise ChecksumMismatchError(problem)
