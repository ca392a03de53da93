"""Names of the metrics that travel between clients and the server, declared once.

Upload metrics (``UploadHeader.metrics``) describe one local training; report metrics
(``ReportRequest.metrics``) describe the personalized model or the end of a client's run.
"""

from __future__ import annotations

# upload metrics
TRAIN_LOSS = "train_loss"  # mean training loss of the GM phase
TRAIN_STEPS = "train_steps"  # optimizer steps of the GM phase
KNOWLEDGE_RECEIVED = "knowledge_received"  # classes of global knowledge the client trained with

# upload metrics of algorithms whose local model is the personal one, and PM reports
PM_ACCURACY = "pm_accuracy"  # accuracy of the personalized model on the client's local test set
PM_TEST_SAMPLES = "pm_test_samples"  # size of that local test set (the weight of PM_ACCURACY)

# the report that ends a client's run
FINAL = "final"  # 1.0: the client received the final model and stops
BYTES_UP = "bytes_up"  # bytes the client's uploads carried
GLOBAL_CRC32 = "global_crc32"  # CRC-32 of the final global model as the client received it

UPLOAD_METRICS = (TRAIN_LOSS, TRAIN_STEPS, KNOWLEDGE_RECEIVED, PM_ACCURACY, PM_TEST_SAMPLES)
REPORT_METRICS = (PM_ACCURACY, PM_TEST_SAMPLES, FINAL, BYTES_UP, GLOBAL_CRC32)
