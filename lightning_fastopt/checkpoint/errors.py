"""The error of a checkpoint that cannot be read as one (its readers and checksums raise it)."""


class BrokenCheckpointError(ValueError):
    """A checkpoint file (or a sharded directory's manifest) cannot be read as one."""
