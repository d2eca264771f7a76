from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_SHARED_MEMORY: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_SHARED_MEMORY: Transport

class SpatialLayout(_message.Message):
    __slots__ = ("parts", "halo", "boundary")
    PARTS_FIELD_NUMBER: _ClassVar[int]
    HALO_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedScalarFieldContainer[int]
    halo: _containers.RepeatedScalarFieldContainer[int]
    boundary: str
    def __init__(self, parts: _Optional[_Iterable[int]] = ..., halo: _Optional[_Iterable[int]] = ..., boundary: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("dataset_path", "seed", "global_batch", "world_size", "spatial", "shuffle", "drop_last", "job_id", "fields", "client", "shuffle_mode")
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_MODE_FIELD_NUMBER: _ClassVar[int]
    dataset_path: str
    seed: int
    global_batch: int
    world_size: int
    spatial: SpatialLayout
    shuffle: bool
    drop_last: bool
    job_id: str
    fields: _containers.RepeatedScalarFieldContainer[str]
    client: ClientProcess
    shuffle_mode: str
    def __init__(self, dataset_path: _Optional[str] = ..., seed: _Optional[int] = ..., global_batch: _Optional[int] = ..., world_size: _Optional[int] = ..., spatial: _Optional[_Union[SpatialLayout, _Mapping]] = ..., shuffle: _Optional[bool] = ..., drop_last: _Optional[bool] = ..., job_id: _Optional[str] = ..., fields: _Optional[_Iterable[str]] = ..., client: _Optional[_Union[ClientProcess, _Mapping]] = ..., shuffle_mode: _Optional[str] = ...) -> None: ...

class ClientProcess(_message.Message):
    __slots__ = ("pid", "start_ticks", "boot_id")
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    start_ticks: int
    boot_id: str
    def __init__(self, pid: _Optional[int] = ..., start_ticks: _Optional[int] = ..., boot_id: _Optional[str] = ...) -> None: ...

class FieldInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "spatial_axes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_AXES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    spatial_axes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., spatial_axes: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "num_samples", "steps_per_epoch", "fields", "shuffle", "dataset_identity")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    DATASET_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_samples: int
    steps_per_epoch: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldInfo]
    shuffle: str
    dataset_identity: str
    def __init__(self, session_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., steps_per_epoch: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldInfo, _Mapping]]] = ..., shuffle: _Optional[str] = ..., dataset_identity: _Optional[str] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("session_id", "rank", "epoch", "start_step", "max_batches", "transport", "prefetch", "done", "mapped", "held")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    rank: int
    epoch: int
    start_step: int
    max_batches: int
    transport: Transport
    prefetch: int
    done: _containers.RepeatedScalarFieldContainer[int]
    mapped: bool
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., rank: _Optional[int] = ..., epoch: _Optional[int] = ..., start_step: _Optional[int] = ..., max_batches: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., prefetch: _Optional[int] = ..., done: _Optional[_Iterable[int]] = ..., mapped: _Optional[bool] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("path", "offset", "length", "generation")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    generation: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "origin", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    origin: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., origin: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("meta", "data", "shm")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    meta: TensorMeta
    data: bytes
    shm: SharedMemoryRegion
    def __init__(self, meta: _Optional[_Union[TensorMeta, _Mapping]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("epoch", "step", "rank", "sample_indices", "tensors", "last_in_epoch", "chunk_total", "chunk_offset", "chunk")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LAST_IN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    rank: int
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    last_in_epoch: bool
    chunk_total: int
    chunk_offset: int
    chunk: bytes
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., sample_indices: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., last_in_epoch: _Optional[bool] = ..., chunk_total: _Optional[int] = ..., chunk_offset: _Optional[int] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatasetStatus(_message.Message):
    __slots__ = ("path", "format", "num_samples", "bytes_total", "bytes_resident", "sessions", "loading", "last_used_unix_s", "hits", "misses", "local_samples", "load_error", "bytes_read")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    path: str
    format: str
    num_samples: int
    bytes_total: int
    bytes_resident: int
    sessions: int
    loading: bool
    last_used_unix_s: float
    hits: int
    misses: int
    local_samples: int
    load_error: str
    bytes_read: int
    def __init__(self, path: _Optional[str] = ..., format: _Optional[str] = ..., num_samples: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_resident: _Optional[int] = ..., sessions: _Optional[int] = ..., loading: _Optional[bool] = ..., last_used_unix_s: _Optional[float] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., local_samples: _Optional[int] = ..., load_error: _Optional[str] = ..., bytes_read: _Optional[int] = ...) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "dataset_path", "job_id", "world_size", "global_batch", "clients", "batches_served", "bytes_served", "opened_unix_s", "streams", "stall_s", "idle_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    dataset_path: str
    job_id: str
    world_size: int
    global_batch: int
    clients: int
    batches_served: int
    bytes_served: int
    opened_unix_s: float
    streams: int
    stall_s: float
    idle_s: float
    def __init__(self, session_id: _Optional[str] = ..., dataset_path: _Optional[str] = ..., job_id: _Optional[str] = ..., world_size: _Optional[int] = ..., global_batch: _Optional[int] = ..., clients: _Optional[int] = ..., batches_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., opened_unix_s: _Optional[float] = ..., streams: _Optional[int] = ..., stall_s: _Optional[float] = ..., idle_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "pid", "uptime_s", "listen", "datasets", "sessions", "clients", "batches_served", "bytes_served", "calls_served", "memory_budget", "bytes_resident", "bytes_exchanged", "node", "nodes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    CALLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_EXCHANGED_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    version: str
    pid: int
    uptime_s: float
    listen: _containers.RepeatedScalarFieldContainer[str]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetStatus]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    clients: int
    batches_served: int
    bytes_served: int
    calls_served: int
    memory_budget: int
    bytes_resident: int
    bytes_exchanged: int
    node: int
    nodes: int
    def __init__(self, version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., listen: _Optional[_Iterable[str]] = ..., datasets: _Optional[_Iterable[_Union[DatasetStatus, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., clients: _Optional[int] = ..., batches_served: _Optional[int] = ..., bytes_served: _Optional[int] = ..., calls_served: _Optional[int] = ..., memory_budget: _Optional[int] = ..., bytes_resident: _Optional[int] = ..., bytes_exchanged: _Optional[int] = ..., node: _Optional[int] = ..., nodes: _Optional[int] = ...) -> None: ...

class LoadDatasetRequest(_message.Message):
    __slots__ = ("dataset_path", "wait")
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    dataset_path: str
    wait: bool
    def __init__(self, dataset_path: _Optional[str] = ..., wait: _Optional[bool] = ...) -> None: ...

class LoadDatasetResponse(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetStatus
    def __init__(self, dataset: _Optional[_Union[DatasetStatus, _Mapping]] = ...) -> None: ...

class UnloadDatasetRequest(_message.Message):
    __slots__ = ("dataset_path",)
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    dataset_path: str
    def __init__(self, dataset_path: _Optional[str] = ...) -> None: ...

class UnloadDatasetResponse(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("sources", "dest", "verify", "unpack", "streams", "load")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    UNPACK_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedScalarFieldContainer[str]
    dest: str
    verify: bool
    unpack: bool
    streams: int
    load: bool
    def __init__(self, sources: _Optional[_Iterable[str]] = ..., dest: _Optional[str] = ..., verify: _Optional[bool] = ..., unpack: _Optional[bool] = ..., streams: _Optional[int] = ..., load: _Optional[bool] = ...) -> None: ...

class StageProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "done", "exit_code", "summary_json", "message")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    done: bool
    exit_code: int
    summary_json: str
    message: str
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., done: _Optional[bool] = ..., exit_code: _Optional[int] = ..., summary_json: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("grace_s", "reason")
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    reason: str
    def __init__(self, grace_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class PeerHeader(_message.Message):
    __slots__ = ("from_node", "to_node", "nodes")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    from_node: int
    to_node: int
    nodes: int
    def __init__(self, from_node: _Optional[int] = ..., to_node: _Optional[int] = ..., nodes: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("header", "dataset_path")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    header: PeerHeader
    dataset_path: str
    def __init__(self, header: _Optional[_Union[PeerHeader, _Mapping]] = ..., dataset_path: _Optional[str] = ...) -> None: ...

class FieldSignature(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("shardable", "files", "fields")
    SHARDABLE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    shardable: bool
    files: _containers.RepeatedScalarFieldContainer[str]
    fields: _containers.RepeatedCompositeFieldContainer[FieldSignature]
    def __init__(self, shardable: _Optional[bool] = ..., files: _Optional[_Iterable[str]] = ..., fields: _Optional[_Iterable[_Union[FieldSignature, _Mapping]]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("header", "dataset_path", "samples", "fields", "spatial", "block", "pieces", "index")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATASET_PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    header: PeerHeader
    dataset_path: str
    samples: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedScalarFieldContainer[str]
    spatial: SpatialLayout
    block: int
    pieces: bool
    index: bytes
    def __init__(self, header: _Optional[_Union[PeerHeader, _Mapping]] = ..., dataset_path: _Optional[str] = ..., samples: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[str]] = ..., spatial: _Optional[_Union[SpatialLayout, _Mapping]] = ..., block: _Optional[int] = ..., pieces: _Optional[bool] = ..., index: _Optional[bytes] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class OpenDataRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: PeerHeader
    def __init__(self, header: _Optional[_Union[PeerHeader, _Mapping]] = ...) -> None: ...

class OpenDataResponse(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class JobFailedRequest(_message.Message):
    __slots__ = ("header", "job", "why")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    header: PeerHeader
    job: str
    why: str
    def __init__(self, header: _Optional[_Union[PeerHeader, _Mapping]] = ..., job: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class JobFailedResponse(_message.Message):
    __slots__ = ("streams",)
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    streams: int
    def __init__(self, streams: _Optional[int] = ...) -> None: ...
