"""Where Lightning's messages go, kept while ``lightning_fastopt`` imports Lightning's packages.

``lightning.pytorch`` and ``pytorch_lightning`` (and their Fabric packages) share one
rank-zero logger and one deprecation-warning class, in ``lightning_utilities``; each points
them at its own when imported, so the package imported last decides where every
Lightning message goes.  ``import lightning_fastopt`` imports ``lightning.pytorch``, and
``pytorch_lightning`` where installed, to register its strategies: it must not move a
project's messages to another logger (configured elsewhere, or not at all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import lightning_utilities.core.rank_zero as _shared

_SHARED_NAMES = ("log", "rank_zero_deprecation_category")


@contextlib.contextmanager
def lightnings_logging_kept() -> Iterator[None]:
    """Whatever is imported inside the block, Lightning's messages go on to the logger they
    went to before it, when a Lightning package had chosen one (else to the last chosen)."""
    before = {name: getattr(_shared, name) for name in _SHARED_NAMES if hasattr(_shared, name)}
    chosen = "log" in before and before["log"].name != _shared.__name__
    try:
        yield
    finally:
        if chosen:
            for name, value in before.items():
                setattr(_shared, name, value)
