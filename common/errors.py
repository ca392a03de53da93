"""The one refusal type: every check on the server raises :class:`Refused` with a status code.

The codes are gRPC's status names; only the gRPC service maps them to ``grpc.StatusCode`` (the
rest of wafl, the in-process transport included, never imports gRPC to refuse something).
"""

from __future__ import annotations

import enum


class Code(enum.StrEnum):
    """The statuses wafl answers with (gRPC's names and meanings)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DATA_LOSS = "DATA_LOSS"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"


class Refused(Exception):
    """A request (or one message of a stream) cannot be accepted; ``code`` says why in gRPC's terms."""

    def __init__(self, message: str, code: Code = Code.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


class InvariantError(RuntimeError):
    """An internal invariant does not hold (a method called out of order, a state that cannot arise):
    a bug in wafl or in the code that drives it, not bad input; the message says what is wrong."""


class UsageError(Exception):
    """A mistake in how wafl was started (a file, a folder, an address); its message is one line
    for the user, printed without a traceback."""


class RunAborted(RuntimeError):
    """A run stopped before its end for a reason the user can act on: the server's run cannot go on (too few
    clients joined, none uploaded for too long), or a whole ``wafl run`` on this machine stopped (``--timeout``
    passed, every client process failed, the server never listened). Its message is one line for the user
    (with where the run's logs are, where there are some), logged and printed without a traceback (exit
    status 1)."""


class TrainingDiverged(RunAborted):
    """A client's local training gave NaN or Inf weights: the client stops with one line naming the round and the
    tensor (the server would refuse the upload as malformed), instead of uploading it."""


class AlreadyAccepted(Exception):
    """A retry of an upload that was already committed (same client, version and idempotency key)."""

    def __init__(self, version: int, nbytes: int) -> None:
        super().__init__(f"duplicate of the upload accepted for round {version}")
        self.version = version  # the version the upload was trained from (the wire's ``round``)
        self.nbytes = nbytes
