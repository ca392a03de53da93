"""What a long-lived process of a run (``wafl server``, ``wafl client``, ``wafl worker``) sets up first:
its log and its torch threads."""

from __future__ import annotations


def setup_logging(component: str, log_file: str | None, quiet: bool = False) -> None:
    """JSON log lines of ``component`` into ``log_file``, and to the console unless ``quiet``."""
    from wafl.common.logs import configure_logging

    configure_logging(component, log_file, console=not quiet)


def set_threads(n: int | None) -> None:
    """torch's intra-op threads: ``--threads`` (default 1)."""
    import torch

    torch.set_num_threads(n or 1)
