"""Names of the metrics that travel between clients and the server, declared once, with the
values each may take (``protos/wafl/v1/federation.proto`` documents the same list).

Upload metrics (``UploadHeader.metrics``) describe one local training; report metrics
(``ReportRequest.metrics``) describe the personalized model or the end of a client's run. A
metric that is not declared for its message, or whose value lies outside its range, is refused
(:func:`check`), so that nothing undeclared reaches the results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from wafl.common.errors import Refused

# upload metrics
TRAIN_LOSS = "train_loss"  # mean training loss of the GM phase (results: mean over uploads weighted by num_samples)
TRAIN_STEPS = "train_steps"  # optimizer steps of the GM phase
KNOWLEDGE_RECEIVED = "knowledge_received"  # classes of global knowledge the client trained with

# upload metrics of algorithms whose local model is the personal one, and PM reports
PM_ACCURACY = "pm_accuracy"  # accuracy of the personalized model on the client's local test set
PM_TEST_SAMPLES = "pm_test_samples"  # size of that local test set (the weight of PM_ACCURACY; 1 when absent)

# upload metrics of algorithms without a personal model: the locally trained model (the FedHKD
# paper's "local accuracy" of FedAvg and its kin; the results' local_accuracy)
LOCAL_ACCURACY = "local_accuracy"  # accuracy of the model just trained, on the client's local test set
LOCAL_TEST_SAMPLES = "local_test_samples"  # size of that local test set (the weight of LOCAL_ACCURACY; 1 when absent)

# the report that ends a client's run
FINAL = "final"  # 1: the client received the final model and stops
BYTES_UP = "bytes_up"  # bytes the client's uploads carried
GLOBAL_CRC32 = "global_crc32"  # CRC-32 of the final global model as the client received it

# the report of a new client (new_clients) on a global model it adapted (wafl.common.heterogeneity)
NEW_CLIENT_ACCURACY = "new_client_accuracy"  # accuracy of the adapted model on the new client's local test set
NEW_CLIENT_TEST_SAMPLES = "new_client_test_samples"  # size of that test set (the weight of NEW_CLIENT_ACCURACY)

# the phases of a client's timeline (ReportRequest.timeline; the server refuses any other)
PHASES = ("gm_train", "upload", "pm_train", "idle", "evaluate", "slowdown", "offline", "decide")
# "decide": a zero-length mark of an adaptive client's decision, before its pre-upload PM (client/adaptive.py)


@dataclass(frozen=True)
class Declared:
    """The values a metric may take: finite, in ``[low, high]``, whole numbers when ``integer``."""

    low: float
    high: float = math.inf
    integer: bool = False

    def admits(self, value: float) -> bool:
        return math.isfinite(value) and self.low <= value <= self.high and (not self.integer or value == int(value))

    def describe(self) -> str:
        kind = "a whole number" if self.integer else "a finite number"
        return f"{kind} in [{self.low:g}, {self.high:g}]"


COUNT = Declared(0.0, integer=True)
SHARE = Declared(0.0, 1.0)

UPLOAD: dict[str, Declared] = {
    TRAIN_LOSS: Declared(-math.inf),  # a regularized objective (FedDyn's linear term) may be negative
    TRAIN_STEPS: COUNT,
    KNOWLEDGE_RECEIVED: COUNT,
    PM_ACCURACY: SHARE,
    PM_TEST_SAMPLES: COUNT,
    LOCAL_ACCURACY: SHARE,
    LOCAL_TEST_SAMPLES: COUNT,
}
REPORT: dict[str, Declared] = {
    PM_ACCURACY: SHARE,
    PM_TEST_SAMPLES: COUNT,
    FINAL: Declared(0.0, 1.0, integer=True),
    BYTES_UP: COUNT,
    GLOBAL_CRC32: Declared(0.0, float(2**32 - 1), integer=True),
    NEW_CLIENT_ACCURACY: SHARE,
    NEW_CLIENT_TEST_SAMPLES: COUNT,
}
UPLOAD_METRICS = tuple(UPLOAD)
REPORT_METRICS = tuple(REPORT)


def check(metrics: Mapping[str, float], declared: Mapping[str, Declared], where: str) -> None:
    """Raises :class:`Refused` (``INVALID_ARGUMENT``) for a metric ``declared`` does not name or admit."""
    for name, value in metrics.items():
        rule = declared.get(name)
        if rule is None:
            raise Refused(f"{where} metric {name[:64]!r} is not declared; {where} metrics: {', '.join(declared)}")
        if not rule.admits(value):
            raise Refused(f"{where} metric {name!r} = {value!r} must be {rule.describe()}")
