"""A checkpoint that torch's safe loader refuses, told apart from a damaged one.

Since torch 2.6 ``torch.load`` reads with ``weights_only=True`` unless told otherwise: a
file whose pickle names a class or function outside torch's allow-list (a user's config
dataclass in ``hyper_parameters``, or ``os.system`` in a crafted file) is refused with
``UnpicklingError: Weights only load failed ...``, and nothing in it runs.  The file is not
damaged; the user who trusts it can load it.  :func:`refusal` recognises that error and
names what was refused (the pickle's globals outside the allow-list, read statically by
``torch.serialization.get_unsafe_globals_in_checkpoint``); a file whose pickle cannot even
be read that way is damaged, and stays the reader's :class:`BrokenCheckpointError`.

torch's distributed checkpoints hold more pickles than the one ``meta.pt``: every
non-tensor entry (an optimizer's ``lr``, ``betas``, ...) is a small ``torch.save`` blob in
the ``.distcp`` files, which torch's own load planner reads with ``weights_only=False``
whatever the caller asked.  :func:`check_distributed` reads each of them, and ``meta.pt``,
with the loader the caller asked for before any state is loaded, so that the safe default
holds for the whole directory (Lightning's ``ModelParallelStrategy`` does not check them).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch

from lightning_fastopt.checkpoint.atomic import SHARDED_METADATA, is_distributed

# the first words of the error torch.load raises when its safe unpickler refuses a file
_REFUSED = "Weights only load failed"


class SafeLoaderRefusedError(pickle.UnpicklingError):
    """torch's safe loader (``weights_only=True``) refused a checkpoint file: it holds
    Python objects outside torch's allow-list (``names``).  The file is not damaged.

    A subclass of ``pickle.UnpicklingError``, the error torch (and so plain Lightning)
    raises for the same file."""

    # the ways to load a file one trusts without its safe loader, as most entry points take them
    WAYS = ("weights_only=False (trainer.fit(..., weights_only=False), fabric.load(..., weights_only=False), "
            "python -m lightning_fastopt.checkpoint consolidate --no-weights-only)")

    def __init__(self, where: str, names: list[str], reason: str = "", ways: str | None = None) -> None:
        self.where, self.names, self._reason, self._ways = where, list(names), reason, ways
        if names:
            held = f"it holds Python objects that torch's safe loader (weights_only=True) does not load: " \
                   f"{', '.join(names)}"
            allow = f"torch.serialization.add_safe_globals([{', '.join(_short(n) for n in names)}]) " \
                    f"(the classes or functions themselves, imported) before loading"
        else:
            held = f"torch's safe loader (weights_only=True) refused it ({reason or 'no reason given'})"
            allow = "torch.serialization.add_safe_globals([...]) with what it names"
        super().__init__(
            f"{where} was not loaded, for safety: {held}. The file is not damaged. If you trust where it comes "
            f"from, load it with {ways or self.WAYS}, or allow them with {allow}; loading without weights_only "
            f"runs whatever the file's pickle calls.")

    def __reduce__(self):  # (pickled with its own arguments: an error crossing processes)
        return type(self), (self.where, self.names, self._reason, self._ways)

    def with_ways(self, ways: str) -> SafeLoaderRefusedError:
        """The same refusal, giving ``ways`` as the ways to load without the safe loader."""
        return SafeLoaderRefusedError(self.where, self.names, self._reason, ways)


class CheckpointClassNotFoundError(ImportError):
    """A checkpoint file loaded without ``weights_only`` names classes or functions that
    this process cannot import (``names``): one defined in the script that saved it
    (``__main__.UserConfig``), or in a package not installed here.  The file is not damaged."""

    def __init__(self, where: str, names: list[str]) -> None:
        self.where, self.names = where, list(names)
        main = [n for n in names if n.startswith("__main__.")]
        hint = (f" {', '.join(main)} {'was' if len(main) == 1 else 'were'} defined in the script that saved it: "
                "load it from that script (lightning_fastopt.checkpoint.consolidate(PATH, OUT, weights_only=False) "
                "for consolidate), or set them on the __main__ module before loading.") if main else ""
        super().__init__(f"{where} names Python classes or functions that this process cannot import: "
                         f"{', '.join(names)}. The file is not damaged: load it where they can be imported.{hint}")

    def __reduce__(self):  # (pickled with its own arguments: an error crossing processes)
        return type(self), (self.where, self.names)


def missing_classes(source: Any, error: BaseException, where: str) -> CheckpointClassNotFoundError | None:
    """The :class:`CheckpointClassNotFoundError` that ``error`` (raised by ``torch.load``
    reading ``source`` without ``weights_only``) is, or None: an ``AttributeError`` or
    ``ImportError`` while unpickling, where the file's pickle names globals that cannot be
    imported here."""
    if not isinstance(error, (AttributeError, ImportError)):
        return None
    unsafe = _unsafe_globals(source)
    names = [n for n in unsafe or () if not _importable(n)]
    return CheckpointClassNotFoundError(where, names) if names else None


def _unsafe_globals(source: Any) -> list[str] | None:
    """The globals ``source``'s pickle names that torch's safe loader does not allow, read
    statically (sorted); None where the pickle cannot be read even so: damaged."""
    if hasattr(source, "seek"):
        source.seek(0)
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:
        return None


def _importable(name: str) -> bool:
    module, _, attribute = name.rpartition(".")
    try:
        found = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
    except Exception:
        return False
    return True


def _short(name: str) -> str:
    return name.rpartition(".")[2] or name


def refusal(source: Any, error: BaseException, where: str) -> SafeLoaderRefusedError | None:
    """The refusal that ``error`` (raised by ``torch.load`` reading ``source``: a path or a
    file object) is, or None where it is something else (damage, a missing file)."""
    if not (isinstance(error, pickle.UnpicklingError) and str(error).startswith(_REFUSED)):
        return None
    if isinstance(error, SafeLoaderRefusedError):
        return error
    names = _unsafe_globals(source)
    if names is None:
        return None  # its pickle cannot be read, even statically: damaged
    return SafeLoaderRefusedError(where, names, reason="" if names else _reason(error))


def _reason(error: BaseException) -> str:
    """torch's own line on why it refused (after ``WeightsUnpickler error:``)."""
    for line in str(error).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return ""


def check_before_loading(path, weights_only: bool | None) -> None:
    """:func:`check_distributed` for a distributed checkpoint directory, :func:`check_file`
    for a file (what Lightning's FSDP strategies read); anything else is left to the load."""
    if is_distributed(path):
        check_distributed(path, weights_only)
    elif os.path.isfile(path):
        check_file(path, weights_only)


def check_file(path, weights_only: bool | None) -> None:
    """Raise :class:`SafeLoaderRefusedError` before any state is loaded where ``torch.load``
    would refuse the checkpoint file ``path`` with ``weights_only`` (None: torch's default).
    Cheap: the file's pickle is only read statically, and loaded only when that finds
    something torch may refuse."""
    if weights_only is False or not os.path.isfile(path):
        return
    try:
        suspects = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return  # not a torch zip file, or damaged: the load that follows says so
    if suspects:
        try:
            torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
        except pickle.UnpicklingError as err:
            refused = refusal(path, err, f"the checkpoint file {os.fspath(path)}")
            if refused is not None:
                raise refused from err


def check_distributed(path, weights_only: bool | None) -> None:
    """Raise :class:`SafeLoaderRefusedError` where a distributed checkpoint directory holds a
    pickle that ``torch.load(weights_only=...)`` refuses: its ``meta.pt`` or any non-tensor
    entry of its ``.distcp`` files (which torch's planner would load unchecked).  Nothing
    is loaded into the model or the optimizers."""
    if weights_only is False:
        return
    check_file(os.path.join(os.fspath(path), SHARDED_METADATA), weights_only)
    _load_entries_safely(path, weights_only)


def _load_entries_safely(path, weights_only: bool | None) -> dict[str, Any]:
    """Every non-tensor entry of the distributed checkpoint at ``path``, each read with
    ``torch.load(weights_only=weights_only)``."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    class EntriesPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=weights_only)
            except pickle.UnpicklingError as err:
                refused = refusal(value, err, f"the entry {fqn!r} of the distributed checkpoint {os.fspath(path)}")
                if refused is not None:
                    raise refused from err
                raise

    reader = FileSystemReader(os.fspath(path))
    metadata = reader.read_metadata()
    entries = {fqn: None for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    if entries:
        try:
            load(entries, storage_reader=reader, no_dist=True,
                 planner=EntriesPlanner(flatten_state_dict=False, allow_partial_load=True))
        except CheckpointException as err:  # torch's wrapper of each rank's error: ours inside, if any
            for failed, _ in dict(getattr(err, "failures", None) or {}).values():
                if isinstance(failed, SafeLoaderRefusedError):
                    raise failed from err
            raise
    return entries
