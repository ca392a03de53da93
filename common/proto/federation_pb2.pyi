from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
UINT8: DType
BOOL: DType

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ...) -> None: ...

class ClassKnowledge(_message.Message):
    __slots__ = ("class_id", "count", "representation", "soft_prediction")
    CLASS_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REPRESENTATION_FIELD_NUMBER: _ClassVar[int]
    SOFT_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    class_id: int
    count: int
    representation: _containers.RepeatedScalarFieldContainer[float]
    soft_prediction: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, class_id: _Optional[int] = ..., count: _Optional[int] = ..., representation: _Optional[_Iterable[float]] = ..., soft_prediction: _Optional[_Iterable[float]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("client_id", "token", "protocol_version", "client_index", "num_samples", "device")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    token: str
    protocol_version: int
    client_index: int
    num_samples: int
    device: str
    def __init__(self, client_id: _Optional[str] = ..., token: _Optional[str] = ..., protocol_version: _Optional[int] = ..., client_index: _Optional[int] = ..., num_samples: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("run_id", "algorithm", "config_json", "model", "manifest", "round", "num_classes", "code_len", "session_credential", "max_samples")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    CODE_LEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    algorithm: str
    config_json: str
    model: str
    manifest: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    round: int
    num_classes: int
    code_len: int
    session_credential: str
    max_samples: int
    def __init__(self, run_id: _Optional[str] = ..., algorithm: _Optional[str] = ..., config_json: _Optional[str] = ..., model: _Optional[str] = ..., manifest: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., round: _Optional[int] = ..., num_classes: _Optional[int] = ..., code_len: _Optional[int] = ..., session_credential: _Optional[str] = ..., max_samples: _Optional[int] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("run_id", "client_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    client_id: str
    def __init__(self, run_id: _Optional[str] = ..., client_id: _Optional[str] = ...) -> None: ...

class BroadcastHeader(_message.Message):
    __slots__ = ("run_id", "round", "final", "num_tensors", "total_bytes", "train", "adapt", "upload_delta", "asynchronous")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    ADAPT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_DELTA_FIELD_NUMBER: _ClassVar[int]
    ASYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    final: bool
    num_tensors: int
    total_bytes: int
    train: bool
    adapt: bool
    upload_delta: bool
    asynchronous: bool
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., final: _Optional[bool] = ..., num_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., train: _Optional[bool] = ..., adapt: _Optional[bool] = ..., upload_delta: _Optional[bool] = ..., asynchronous: _Optional[bool] = ...) -> None: ...

class BroadcastTrailer(_message.Message):
    __slots__ = ("crc32", "num_chunks")
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    crc32: int
    num_chunks: int
    def __init__(self, crc32: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class BroadcastMessage(_message.Message):
    __slots__ = ("header", "chunk", "knowledge", "trailer", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: BroadcastHeader
    chunk: TensorChunk
    knowledge: ClassKnowledge
    trailer: BroadcastTrailer
    batch: TensorChunkBatch
    def __init__(self, header: _Optional[_Union[BroadcastHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., knowledge: _Optional[_Union[ClassKnowledge, _Mapping]] = ..., trailer: _Optional[_Union[BroadcastTrailer, _Mapping]] = ..., batch: _Optional[_Union[TensorChunkBatch, _Mapping]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("run_id", "round", "client_id", "num_samples", "idempotency_key", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    client_id: str
    num_samples: int
    idempotency_key: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., client_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class UploadTrailer(_message.Message):
    __slots__ = ("crc32", "num_chunks")
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    crc32: int
    num_chunks: int
    def __init__(self, crc32: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class UploadMessage(_message.Message):
    __slots__ = ("header", "chunk", "knowledge", "trailer", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: TensorChunk
    knowledge: ClassKnowledge
    trailer: UploadTrailer
    batch: TensorChunkBatch
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., knowledge: _Optional[_Union[ClassKnowledge, _Mapping]] = ..., trailer: _Optional[_Union[UploadTrailer, _Mapping]] = ..., batch: _Optional[_Union[TensorChunkBatch, _Mapping]] = ...) -> None: ...

class UploadReply(_message.Message):
    __slots__ = ("accepted", "round", "bytes_received")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round: int
    bytes_received: int
    def __init__(self, accepted: _Optional[bool] = ..., round: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class PhaseEvent(_message.Message):
    __slots__ = ("phase", "round", "start_s", "end_s")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    phase: str
    round: int
    start_s: float
    end_s: float
    def __init__(self, phase: _Optional[str] = ..., round: _Optional[int] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("run_id", "client_id", "round", "metrics", "timeline", "client_start_unix")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_START_UNIX_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    client_id: str
    round: int
    metrics: _containers.ScalarMap[str, float]
    timeline: _containers.RepeatedCompositeFieldContainer[PhaseEvent]
    client_start_unix: float
    def __init__(self, run_id: _Optional[str] = ..., client_id: _Optional[str] = ..., round: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., timeline: _Optional[_Iterable[_Union[PhaseEvent, _Mapping]]] = ..., client_start_unix: _Optional[float] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
