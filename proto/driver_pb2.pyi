from unbroken.proto import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_RUNNING: _ClassVar[WorkerState]
    WORKER_STATE_EXITED: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_PAUSED: _ClassVar[WorkerState]

class HeartbeatFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEARTBEAT_FLAG_NONE: _ClassVar[HeartbeatFlag]
    HEARTBEAT_FLAG_WORKER_EXITED: _ClassVar[HeartbeatFlag]
    HEARTBEAT_FLAG_LOG_ALERTS: _ClassVar[HeartbeatFlag]
    HEARTBEAT_FLAG_STALLED: _ClassVar[HeartbeatFlag]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_KIND_WORKER: _ClassVar[FailureKind]
    FAILURE_KIND_NODE: _ClassVar[FailureKind]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_RUNNING: WorkerState
WORKER_STATE_EXITED: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_PAUSED: WorkerState
HEARTBEAT_FLAG_NONE: HeartbeatFlag
HEARTBEAT_FLAG_WORKER_EXITED: HeartbeatFlag
HEARTBEAT_FLAG_LOG_ALERTS: HeartbeatFlag
HEARTBEAT_FLAG_STALLED: HeartbeatFlag
FAILURE_KIND_UNSPECIFIED: FailureKind
FAILURE_KIND_WORKER: FailureKind
FAILURE_KIND_NODE: FailureKind

class GpuInfo(_message.Message):
    __slots__ = ("index", "name", "uuid", "memory_total_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ...) -> None: ...

class HardwareInventory(_message.Message):
    __slots__ = ("cpu_count", "memory_total_bytes", "gpus", "rdma_devices")
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RDMA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    cpu_count: int
    memory_total_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    rdma_devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cpu_count: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., rdma_devices: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "hostname", "ip", "pod_name", "inventory", "agent_version", "num_workers", "spare", "replica_buddy", "replica_listen", "replica_pubkey", "relay_batches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    POD_NAME_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDDY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LISTEN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    RELAY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    hostname: str
    ip: str
    pod_name: str
    inventory: HardwareInventory
    agent_version: str
    num_workers: int
    spare: bool
    replica_buddy: str
    replica_listen: str
    replica_pubkey: bytes
    relay_batches: bool
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., hostname: _Optional[str] = ..., ip: _Optional[str] = ..., pod_name: _Optional[str] = ..., inventory: _Optional[_Union[HardwareInventory, _Mapping]] = ..., agent_version: _Optional[str] = ..., num_workers: _Optional[int] = ..., spare: _Optional[bool] = ..., replica_buddy: _Optional[str] = ..., replica_listen: _Optional[str] = ..., replica_pubkey: _Optional[bytes] = ..., relay_batches: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("driver_id", "heartbeat_interval_ms", "miss_limit", "job_id", "global_rank_base", "world_size", "leader_term", "term_scope", "report_key", "relay_batches", "closed_timeout_ms")
    DRIVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MISS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_BASE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    TERM_SCOPE_FIELD_NUMBER: _ClassVar[int]
    REPORT_KEY_FIELD_NUMBER: _ClassVar[int]
    RELAY_BATCHES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    driver_id: str
    heartbeat_interval_ms: int
    miss_limit: int
    job_id: str
    global_rank_base: int
    world_size: int
    leader_term: int
    term_scope: str
    report_key: bytes
    relay_batches: bool
    closed_timeout_ms: int
    def __init__(self, driver_id: _Optional[str] = ..., heartbeat_interval_ms: _Optional[int] = ..., miss_limit: _Optional[int] = ..., job_id: _Optional[str] = ..., global_rank_base: _Optional[int] = ..., world_size: _Optional[int] = ..., leader_term: _Optional[int] = ..., term_scope: _Optional[str] = ..., report_key: _Optional[bytes] = ..., relay_batches: _Optional[bool] = ..., closed_timeout_ms: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("local_rank", "global_rank", "pid", "state", "exit_code", "step", "loss", "step_time_ms", "since_progress_ms", "median_step_ms", "restarts", "has_loss", "has_peak", "peak_loss", "peak_step", "ring_steps", "hung", "hang_threshold_ms", "phase", "compute_ms", "compute_mad_ms", "wait_ms", "window_steps", "wait_mad_ms", "restored_step", "restored_from", "fingerprints", "loss_median", "loss_mad", "loss_window", "rejoins", "held", "checkpoint_save_share", "data_loading_share")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    SINCE_PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_PEAK_FIELD_NUMBER: _ClassVar[int]
    PEAK_LOSS_FIELD_NUMBER: _ClassVar[int]
    PEAK_STEP_FIELD_NUMBER: _ClassVar[int]
    RING_STEPS_FIELD_NUMBER: _ClassVar[int]
    HUNG_FIELD_NUMBER: _ClassVar[int]
    HANG_THRESHOLD_MS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MAD_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MAD_MS_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    LOSS_MAD_FIELD_NUMBER: _ClassVar[int]
    LOSS_WINDOW_FIELD_NUMBER: _ClassVar[int]
    REJOINS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SAVE_SHARE_FIELD_NUMBER: _ClassVar[int]
    DATA_LOADING_SHARE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    global_rank: int
    pid: int
    state: WorkerState
    exit_code: int
    step: int
    loss: float
    step_time_ms: float
    since_progress_ms: float
    median_step_ms: float
    restarts: int
    has_loss: bool
    has_peak: bool
    peak_loss: float
    peak_step: int
    ring_steps: _containers.RepeatedScalarFieldContainer[int]
    hung: bool
    hang_threshold_ms: float
    phase: str
    compute_ms: float
    compute_mad_ms: float
    wait_ms: float
    window_steps: int
    wait_mad_ms: float
    restored_step: int
    restored_from: str
    fingerprints: _containers.RepeatedCompositeFieldContainer[_events_pb2.RankFingerprint]
    loss_median: float
    loss_mad: float
    loss_window: int
    rejoins: int
    held: bool
    checkpoint_save_share: float
    data_loading_share: float
    def __init__(self, local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., exit_code: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., step_time_ms: _Optional[float] = ..., since_progress_ms: _Optional[float] = ..., median_step_ms: _Optional[float] = ..., restarts: _Optional[int] = ..., has_loss: _Optional[bool] = ..., has_peak: _Optional[bool] = ..., peak_loss: _Optional[float] = ..., peak_step: _Optional[int] = ..., ring_steps: _Optional[_Iterable[int]] = ..., hung: _Optional[bool] = ..., hang_threshold_ms: _Optional[float] = ..., phase: _Optional[str] = ..., compute_ms: _Optional[float] = ..., compute_mad_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., window_steps: _Optional[int] = ..., wait_mad_ms: _Optional[float] = ..., restored_step: _Optional[int] = ..., restored_from: _Optional[str] = ..., fingerprints: _Optional[_Iterable[_Union[_events_pb2.RankFingerprint, _Mapping]]] = ..., loss_median: _Optional[float] = ..., loss_mad: _Optional[float] = ..., loss_window: _Optional[int] = ..., rejoins: _Optional[int] = ..., held: _Optional[bool] = ..., checkpoint_save_share: _Optional[float] = ..., data_loading_share: _Optional[float] = ...) -> None: ...

class HostStats(_message.Message):
    __slots__ = ("cpu_percent", "mem_used_bytes", "mem_total_bytes", "disk_used_bytes", "disk_total_bytes", "net_bytes_sent", "net_bytes_recv", "rdma_counters")
    class RdmaCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NET_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NET_BYTES_RECV_FIELD_NUMBER: _ClassVar[int]
    RDMA_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    mem_used_bytes: int
    mem_total_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int
    net_bytes_sent: int
    net_bytes_recv: int
    rdma_counters: _containers.ScalarMap[str, int]
    def __init__(self, cpu_percent: _Optional[float] = ..., mem_used_bytes: _Optional[int] = ..., mem_total_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_total_bytes: _Optional[int] = ..., net_bytes_sent: _Optional[int] = ..., net_bytes_recv: _Optional[int] = ..., rdma_counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GpuStats(_message.Message):
    __slots__ = ("index", "utilization_percent", "memory_used_bytes", "ecc_errors", "xid_errors")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ECC_ERRORS_FIELD_NUMBER: _ClassVar[int]
    XID_ERRORS_FIELD_NUMBER: _ClassVar[int]
    index: int
    utilization_percent: float
    memory_used_bytes: int
    ecc_errors: int
    xid_errors: int
    def __init__(self, index: _Optional[int] = ..., utilization_percent: _Optional[float] = ..., memory_used_bytes: _Optional[int] = ..., ecc_errors: _Optional[int] = ..., xid_errors: _Optional[int] = ...) -> None: ...

class LogAlertLine(_message.Message):
    __slots__ = ("local_rank", "keyword", "line")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    keyword: str
    line: str
    def __init__(self, local_rank: _Optional[int] = ..., keyword: _Optional[str] = ..., line: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "flags", "workers", "host", "gpus", "alerts", "sent_mono_ns", "attached", "hang_stacks", "replicas", "timing", "persist_error", "persist_failures", "persist_failing_s", "loop_lag_ms", "late_ms", "cpu_pressure_pct", "runnable_per_cpu", "buddy_opinions", "fingerprint_ranks", "start_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ALERTS_FIELD_NUMBER: _ClassVar[int]
    SENT_MONO_NS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    HANG_STACKS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PERSIST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FAILING_S_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_MS_FIELD_NUMBER: _ClassVar[int]
    LATE_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_PRESSURE_PCT_FIELD_NUMBER: _ClassVar[int]
    RUNNABLE_PER_CPU_FIELD_NUMBER: _ClassVar[int]
    BUDDY_OPINIONS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_RANKS_FIELD_NUMBER: _ClassVar[int]
    START_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    flags: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    host: HostStats
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStats]
    alerts: _containers.RepeatedCompositeFieldContainer[LogAlertLine]
    sent_mono_ns: int
    attached: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    hang_stacks: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaHeld]
    timing: NodeTiming
    persist_error: str
    persist_failures: int
    persist_failing_s: float
    loop_lag_ms: float
    late_ms: float
    cpu_pressure_pct: float
    runnable_per_cpu: float
    buddy_opinions: _containers.RepeatedCompositeFieldContainer[BuddyOpinion]
    fingerprint_ranks: int
    start_id: str
    def __init__(self, seq: _Optional[int] = ..., flags: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., host: _Optional[_Union[HostStats, _Mapping]] = ..., gpus: _Optional[_Iterable[_Union[GpuStats, _Mapping]]] = ..., alerts: _Optional[_Iterable[_Union[LogAlertLine, _Mapping]]] = ..., sent_mono_ns: _Optional[int] = ..., attached: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., hang_stacks: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaHeld, _Mapping]]] = ..., timing: _Optional[_Union[NodeTiming, _Mapping]] = ..., persist_error: _Optional[str] = ..., persist_failures: _Optional[int] = ..., persist_failing_s: _Optional[float] = ..., loop_lag_ms: _Optional[float] = ..., late_ms: _Optional[float] = ..., cpu_pressure_pct: _Optional[float] = ..., runnable_per_cpu: _Optional[float] = ..., buddy_opinions: _Optional[_Iterable[_Union[BuddyOpinion, _Mapping]]] = ..., fingerprint_ranks: _Optional[int] = ..., start_id: _Optional[str] = ...) -> None: ...

class BuddyOpinion(_message.Message):
    __slots__ = ("node", "fingerprint", "timeline", "error")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node: str
    fingerprint: _events_pb2.RankFingerprint
    timeline: int
    error: str
    def __init__(self, node: _Optional[str] = ..., fingerprint: _Optional[_Union[_events_pb2.RankFingerprint, _Mapping]] = ..., timeline: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class PersistFailure(_message.Message):
    __slots__ = ("node_id", "error", "failures", "failing_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FAILING_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    error: str
    failures: int
    failing_s: float
    def __init__(self, node_id: _Optional[str] = ..., error: _Optional[str] = ..., failures: _Optional[int] = ..., failing_s: _Optional[float] = ...) -> None: ...

class NodeTiming(_message.Message):
    __slots__ = ("generation", "compute_ms", "mad_ms", "wait_ms", "window_steps", "wait_mad_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    MAD_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MAD_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    compute_ms: float
    mad_ms: float
    wait_ms: float
    window_steps: int
    wait_mad_ms: float
    def __init__(self, generation: _Optional[int] = ..., compute_ms: _Optional[float] = ..., mad_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., window_steps: _Optional[int] = ..., wait_mad_ms: _Optional[float] = ...) -> None: ...

class ReplicaHeld(_message.Message):
    __slots__ = ("node", "rank", "steps")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    node: str
    rank: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node: _Optional[str] = ..., rank: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckResult(_message.Message):
    __slots__ = ("command_id", "result_json", "exit_code", "stderr_tail")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    result_json: str
    exit_code: int
    stderr_tail: str
    def __init__(self, command_id: _Optional[str] = ..., result_json: _Optional[str] = ..., exit_code: _Optional[int] = ..., stderr_tail: _Optional[str] = ...) -> None: ...

class CommandAck(_message.Message):
    __slots__ = ("command_id", "ok", "detail", "ring_fresh")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RING_FRESH_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    detail: str
    ring_fresh: bool
    def __init__(self, command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., ring_fresh: _Optional[bool] = ...) -> None: ...

class ShardPersisted(_message.Message):
    __slots__ = ("step", "rank", "uri", "bytes", "checksum", "world_size", "url", "timeline", "persist_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    PERSIST_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    uri: str
    bytes: int
    checksum: int
    world_size: int
    url: str
    timeline: int
    persist_s: float
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., world_size: _Optional[int] = ..., url: _Optional[str] = ..., timeline: _Optional[int] = ..., persist_s: _Optional[float] = ...) -> None: ...

class SelfCheckReport(_message.Message):
    __slots__ = ("command_id", "ok", "failures", "details_json")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    failures: _containers.RepeatedScalarFieldContainer[str]
    details_json: str
    def __init__(self, command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., failures: _Optional[_Iterable[str]] = ..., details_json: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("heartbeat", "check_result", "ack", "shard_persisted", "self_check_report", "shards_persisted", "relay_batch", "relayed", "relayed_batch", "signed_report")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CHECK_RESULT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    SHARD_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_REPORT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    RELAY_BATCH_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BATCH_FIELD_NUMBER: _ClassVar[int]
    SIGNED_REPORT_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    check_result: CheckResult
    ack: CommandAck
    shard_persisted: ShardPersisted
    self_check_report: SelfCheckReport
    shards_persisted: ShardsPersisted
    relay_batch: RelayBatch
    relayed: RelayedUp
    relayed_batch: RelayedUpBatch
    signed_report: SignedReport
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., check_result: _Optional[_Union[CheckResult, _Mapping]] = ..., ack: _Optional[_Union[CommandAck, _Mapping]] = ..., shard_persisted: _Optional[_Union[ShardPersisted, _Mapping]] = ..., self_check_report: _Optional[_Union[SelfCheckReport, _Mapping]] = ..., shards_persisted: _Optional[_Union[ShardsPersisted, _Mapping]] = ..., relay_batch: _Optional[_Union[RelayBatch, _Mapping]] = ..., relayed: _Optional[_Union[RelayedUp, _Mapping]] = ..., relayed_batch: _Optional[_Union[RelayedUpBatch, _Mapping]] = ..., signed_report: _Optional[_Union[SignedReport, _Mapping]] = ...) -> None: ...

class SignedReport(_message.Message):
    __slots__ = ("shards_persisted", "mac")
    SHARDS_PERSISTED_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    shards_persisted: bytes
    mac: bytes
    def __init__(self, shards_persisted: _Optional[bytes] = ..., mac: _Optional[bytes] = ...) -> None: ...

class ShardsPersisted(_message.Message):
    __slots__ = ("shards",)
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[ShardPersisted]
    def __init__(self, shards: _Optional[_Iterable[_Union[ShardPersisted, _Mapping]]] = ...) -> None: ...

class RelayedBeat(_message.Message):
    __slots__ = ("node_id", "epoch", "heartbeat")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    heartbeat: Heartbeat
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class RelaySilent(_message.Message):
    __slots__ = ("node_id", "epoch", "silent_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    silent_ms: float
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., silent_ms: _Optional[float] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("beats", "alive", "silent", "own", "group_alive", "late")
    BEATS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    GROUP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    beats: _containers.RepeatedCompositeFieldContainer[RelayedBeat]
    alive: _containers.RepeatedScalarFieldContainer[str]
    silent: _containers.RepeatedCompositeFieldContainer[RelaySilent]
    own: Heartbeat
    group_alive: bool
    late: _containers.RepeatedCompositeFieldContainer[RelaySilent]
    def __init__(self, beats: _Optional[_Iterable[_Union[RelayedBeat, _Mapping]]] = ..., alive: _Optional[_Iterable[str]] = ..., silent: _Optional[_Iterable[_Union[RelaySilent, _Mapping]]] = ..., own: _Optional[_Union[Heartbeat, _Mapping]] = ..., group_alive: _Optional[bool] = ..., late: _Optional[_Iterable[_Union[RelaySilent, _Mapping]]] = ...) -> None: ...

class RelayedUp(_message.Message):
    __slots__ = ("node_id", "epoch", "message")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    message: AgentMessage
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., message: _Optional[_Union[AgentMessage, _Mapping]] = ...) -> None: ...

class RelayedUpBatch(_message.Message):
    __slots__ = ("up",)
    UP_FIELD_NUMBER: _ClassVar[int]
    up: _containers.RepeatedCompositeFieldContainer[RelayedUp]
    def __init__(self, up: _Optional[_Iterable[_Union[RelayedUp, _Mapping]]] = ...) -> None: ...

class RelayedDownBatch(_message.Message):
    __slots__ = ("down",)
    DOWN_FIELD_NUMBER: _ClassVar[int]
    down: _containers.RepeatedCompositeFieldContainer[RelayedDown]
    def __init__(self, down: _Optional[_Iterable[_Union[RelayedDown, _Mapping]]] = ...) -> None: ...

class RelayedDown(_message.Message):
    __slots__ = ("node_id", "command", "end")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    command: DriverMessage
    end: str
    def __init__(self, node_id: _Optional[str] = ..., command: _Optional[_Union[DriverMessage, _Mapping]] = ..., end: _Optional[str] = ...) -> None: ...

class StartWorkers(_message.Message):
    __slots__ = ("worker_cmd", "world_size", "global_rank_base", "master_addr", "master_port", "dp", "pp", "tp", "timeline", "persist_every_s", "flash_bytes_per_rank", "replaces", "replaces_from", "buddy", "buddy_node", "replicas_from", "buddy_pubkey", "replicas_from_pubkey", "replaces_pubkey", "in_job", "start_id")
    WORKER_CMD_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_BASE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    PERSIST_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    FLASH_BYTES_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FROM_FIELD_NUMBER: _ClassVar[int]
    BUDDY_FIELD_NUMBER: _ClassVar[int]
    BUDDY_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FROM_FIELD_NUMBER: _ClassVar[int]
    BUDDY_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FROM_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    REPLACES_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    IN_JOB_FIELD_NUMBER: _ClassVar[int]
    START_ID_FIELD_NUMBER: _ClassVar[int]
    worker_cmd: str
    world_size: int
    global_rank_base: int
    master_addr: str
    master_port: int
    dp: int
    pp: int
    tp: int
    timeline: int
    persist_every_s: float
    flash_bytes_per_rank: int
    replaces: str
    replaces_from: str
    buddy: str
    buddy_node: str
    replicas_from: str
    buddy_pubkey: bytes
    replicas_from_pubkey: bytes
    replaces_pubkey: bytes
    in_job: bool
    start_id: str
    def __init__(self, worker_cmd: _Optional[str] = ..., world_size: _Optional[int] = ..., global_rank_base: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., dp: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ..., timeline: _Optional[int] = ..., persist_every_s: _Optional[float] = ..., flash_bytes_per_rank: _Optional[int] = ..., replaces: _Optional[str] = ..., replaces_from: _Optional[str] = ..., buddy: _Optional[str] = ..., buddy_node: _Optional[str] = ..., replicas_from: _Optional[str] = ..., buddy_pubkey: _Optional[bytes] = ..., replicas_from_pubkey: _Optional[bytes] = ..., replaces_pubkey: _Optional[bytes] = ..., in_job: _Optional[bool] = ..., start_id: _Optional[str] = ...) -> None: ...

class StopWorkers(_message.Message):
    __slots__ = ("grace_s", "dump_stacks", "in_job", "replace_local_ranks")
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    DUMP_STACKS_FIELD_NUMBER: _ClassVar[int]
    IN_JOB_FIELD_NUMBER: _ClassVar[int]
    REPLACE_LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    dump_stacks: bool
    in_job: bool
    replace_local_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, grace_s: _Optional[float] = ..., dump_stacks: _Optional[bool] = ..., in_job: _Optional[bool] = ..., replace_local_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RestartWorkers(_message.Message):
    __slots__ = ("local_ranks", "dump_stacks")
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    DUMP_STACKS_FIELD_NUMBER: _ClassVar[int]
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    dump_stacks: bool
    def __init__(self, local_ranks: _Optional[_Iterable[int]] = ..., dump_stacks: _Optional[bool] = ...) -> None: ...

class Pause(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("at_step",)
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    at_step: int
    def __init__(self, at_step: _Optional[int] = ...) -> None: ...

class FlashSave(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class RunCheck(_message.Message):
    __slots__ = ("spec_json", "timeout_s")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    timeout_s: float
    def __init__(self, spec_json: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Evict(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RestorePoint(_message.Message):
    __slots__ = ("step", "skip_from_step", "skip_batches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SKIP_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIP_BATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    skip_from_step: int
    skip_batches: int
    def __init__(self, step: _Optional[int] = ..., skip_from_step: _Optional[int] = ..., skip_batches: _Optional[int] = ...) -> None: ...

class RunSelfCheck(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class InjectFault(_message.Message):
    __slots__ = ("kind", "local_rank", "factor", "step", "sdc")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SDC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    local_rank: int
    factor: float
    step: int
    sdc: SdcFault
    def __init__(self, kind: _Optional[str] = ..., local_rank: _Optional[int] = ..., factor: _Optional[float] = ..., step: _Optional[int] = ..., sdc: _Optional[_Union[SdcFault, _Mapping]] = ...) -> None: ...

class SdcFault(_message.Message):
    __slots__ = ("random_rank", "tensor", "bit", "target", "size")
    RANDOM_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    BIT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    random_rank: bool
    tensor: str
    bit: int
    target: str
    size: float
    def __init__(self, random_rank: _Optional[bool] = ..., tensor: _Optional[str] = ..., bit: _Optional[int] = ..., target: _Optional[str] = ..., size: _Optional[float] = ...) -> None: ...

class DriverMessage(_message.Message):
    __slots__ = ("command_id", "term", "term_scope", "start_workers", "stop_workers", "restart_workers", "pause", "resume", "flash_save", "run_check", "evict", "shutdown", "run_self_check", "inject_fault", "restore_point", "retention", "ring_keep", "relayed", "relayed_batch")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    TERM_SCOPE_FIELD_NUMBER: _ClassVar[int]
    START_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STOP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RESTART_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FLASH_SAVE_FIELD_NUMBER: _ClassVar[int]
    RUN_CHECK_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    RUN_SELF_CHECK_FIELD_NUMBER: _ClassVar[int]
    INJECT_FAULT_FIELD_NUMBER: _ClassVar[int]
    RESTORE_POINT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    RING_KEEP_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BATCH_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    term: int
    term_scope: str
    start_workers: StartWorkers
    stop_workers: StopWorkers
    restart_workers: RestartWorkers
    pause: Pause
    resume: Resume
    flash_save: FlashSave
    run_check: RunCheck
    evict: Evict
    shutdown: Shutdown
    run_self_check: RunSelfCheck
    inject_fault: InjectFault
    restore_point: RestorePoint
    retention: Retention
    ring_keep: RingKeep
    relayed: RelayedDown
    relayed_batch: RelayedDownBatch
    def __init__(self, command_id: _Optional[str] = ..., term: _Optional[int] = ..., term_scope: _Optional[str] = ..., start_workers: _Optional[_Union[StartWorkers, _Mapping]] = ..., stop_workers: _Optional[_Union[StopWorkers, _Mapping]] = ..., restart_workers: _Optional[_Union[RestartWorkers, _Mapping]] = ..., pause: _Optional[_Union[Pause, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., flash_save: _Optional[_Union[FlashSave, _Mapping]] = ..., run_check: _Optional[_Union[RunCheck, _Mapping]] = ..., evict: _Optional[_Union[Evict, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., run_self_check: _Optional[_Union[RunSelfCheck, _Mapping]] = ..., inject_fault: _Optional[_Union[InjectFault, _Mapping]] = ..., restore_point: _Optional[_Union[RestorePoint, _Mapping]] = ..., retention: _Optional[_Union[Retention, _Mapping]] = ..., ring_keep: _Optional[_Union[RingKeep, _Mapping]] = ..., relayed: _Optional[_Union[RelayedDown, _Mapping]] = ..., relayed_batch: _Optional[_Union[RelayedDownBatch, _Mapping]] = ...) -> None: ...

class Retention(_message.Message):
    __slots__ = ("keep_steps", "below")
    KEEP_STEPS_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    keep_steps: _containers.RepeatedScalarFieldContainer[int]
    below: int
    def __init__(self, keep_steps: _Optional[_Iterable[int]] = ..., below: _Optional[int] = ...) -> None: ...

class RingKeep(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("job_id", "driver_id", "leader_address", "leader_term", "phase", "step", "live_step", "nodes_total", "nodes_active", "nodes_spare", "nodes_lost", "nodes_evicted", "nodes_alive", "last_seq", "incident_id", "last_diagnosis_id", "diagnosis_running", "goodput", "training_wall_s", "lost_s_by_cause", "lost_s_by_category", "persist_every_s", "persist_cost_s", "storage_mtbf_s", "persist_failing", "newest_commit_step", "newest_commit_age_s", "incident_cause", "failed_restores", "finished_reason", "log_error", "log_failing_s", "log_full", "faults_unrecorded", "mass_silence_nodes", "mass_silence_held_s", "mass_silence_unheard_s", "awaiting_nodes")
    class LostSByCauseEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LostSByCategoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DRIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    NODES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NODES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    NODES_SPARE_FIELD_NUMBER: _ClassVar[int]
    NODES_LOST_FIELD_NUMBER: _ClassVar[int]
    NODES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NODES_ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSIS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_WALL_S_FIELD_NUMBER: _ClassVar[int]
    LOST_S_BY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    LOST_S_BY_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    PERSIST_EVERY_S_FIELD_NUMBER: _ClassVar[int]
    PERSIST_COST_S_FIELD_NUMBER: _ClassVar[int]
    STORAGE_MTBF_S_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FAILING_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMMIT_STEP_FIELD_NUMBER: _ClassVar[int]
    NEWEST_COMMIT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    FAILED_RESTORES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REASON_FIELD_NUMBER: _ClassVar[int]
    LOG_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOG_FAILING_S_FIELD_NUMBER: _ClassVar[int]
    LOG_FULL_FIELD_NUMBER: _ClassVar[int]
    FAULTS_UNRECORDED_FIELD_NUMBER: _ClassVar[int]
    MASS_SILENCE_NODES_FIELD_NUMBER: _ClassVar[int]
    MASS_SILENCE_HELD_S_FIELD_NUMBER: _ClassVar[int]
    MASS_SILENCE_UNHEARD_S_FIELD_NUMBER: _ClassVar[int]
    AWAITING_NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    driver_id: str
    leader_address: str
    leader_term: int
    phase: _events_pb2.Phase
    step: int
    live_step: int
    nodes_total: int
    nodes_active: int
    nodes_spare: int
    nodes_lost: int
    nodes_evicted: int
    nodes_alive: int
    last_seq: int
    incident_id: str
    last_diagnosis_id: str
    diagnosis_running: str
    goodput: float
    training_wall_s: float
    lost_s_by_cause: _containers.ScalarMap[str, float]
    lost_s_by_category: _containers.ScalarMap[str, float]
    persist_every_s: float
    persist_cost_s: float
    storage_mtbf_s: float
    persist_failing: _containers.RepeatedCompositeFieldContainer[PersistFailure]
    newest_commit_step: int
    newest_commit_age_s: float
    incident_cause: str
    failed_restores: int
    finished_reason: str
    log_error: str
    log_failing_s: float
    log_full: bool
    faults_unrecorded: int
    mass_silence_nodes: int
    mass_silence_held_s: float
    mass_silence_unheard_s: float
    awaiting_nodes: str
    def __init__(self, job_id: _Optional[str] = ..., driver_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., leader_term: _Optional[int] = ..., phase: _Optional[_Union[_events_pb2.Phase, str]] = ..., step: _Optional[int] = ..., live_step: _Optional[int] = ..., nodes_total: _Optional[int] = ..., nodes_active: _Optional[int] = ..., nodes_spare: _Optional[int] = ..., nodes_lost: _Optional[int] = ..., nodes_evicted: _Optional[int] = ..., nodes_alive: _Optional[int] = ..., last_seq: _Optional[int] = ..., incident_id: _Optional[str] = ..., last_diagnosis_id: _Optional[str] = ..., diagnosis_running: _Optional[str] = ..., goodput: _Optional[float] = ..., training_wall_s: _Optional[float] = ..., lost_s_by_cause: _Optional[_Mapping[str, float]] = ..., lost_s_by_category: _Optional[_Mapping[str, float]] = ..., persist_every_s: _Optional[float] = ..., persist_cost_s: _Optional[float] = ..., storage_mtbf_s: _Optional[float] = ..., persist_failing: _Optional[_Iterable[_Union[PersistFailure, _Mapping]]] = ..., newest_commit_step: _Optional[int] = ..., newest_commit_age_s: _Optional[float] = ..., incident_cause: _Optional[str] = ..., failed_restores: _Optional[int] = ..., finished_reason: _Optional[str] = ..., log_error: _Optional[str] = ..., log_failing_s: _Optional[float] = ..., log_full: _Optional[bool] = ..., faults_unrecorded: _Optional[int] = ..., mass_silence_nodes: _Optional[int] = ..., mass_silence_held_s: _Optional[float] = ..., mass_silence_unheard_s: _Optional[float] = ..., awaiting_nodes: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ("page_size", "after")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    after: str
    def __init__(self, page_size: _Optional[int] = ..., after: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "state", "alive", "connected", "epoch", "hostname", "ip", "num_workers", "spare", "failures", "silent_ms", "step", "workers", "attached")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: _events_pb2.NodeState
    alive: bool
    connected: bool
    epoch: int
    hostname: str
    ip: str
    num_workers: int
    spare: bool
    failures: int
    silent_ms: float
    step: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    attached: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[_events_pb2.NodeState, str]] = ..., alive: _Optional[bool] = ..., connected: _Optional[bool] = ..., epoch: _Optional[int] = ..., hostname: _Optional[str] = ..., ip: _Optional[str] = ..., num_workers: _Optional[int] = ..., spare: _Optional[bool] = ..., failures: _Optional[int] = ..., silent_ms: _Optional[float] = ..., step: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., attached: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes", "next_after")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    next_after: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., next_after: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("since_seq", "follow")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    follow: bool
    def __init__(self, since_seq: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.Event
    def __init__(self, event: _Optional[_Union[_events_pb2.Event, _Mapping]] = ...) -> None: ...

class DiagnoseRequest(_message.Message):
    __slots__ = ("node_ids", "round_timeout_s", "check_timeout_s")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHECK_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    round_timeout_s: float
    check_timeout_s: float
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., round_timeout_s: _Optional[float] = ..., check_timeout_s: _Optional[float] = ...) -> None: ...

class DiagnoseStarted(_message.Message):
    __slots__ = ("diagnosis_id", "node_ids", "paused_nodes")
    DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_NODES_FIELD_NUMBER: _ClassVar[int]
    diagnosis_id: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    paused_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, diagnosis_id: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ..., paused_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class DiagnoseProgress(_message.Message):
    __slots__ = ("round", "groups_total", "groups_done")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DONE_FIELD_NUMBER: _ClassVar[int]
    round: int
    groups_total: int
    groups_done: int
    def __init__(self, round: _Optional[int] = ..., groups_total: _Optional[int] = ..., groups_done: _Optional[int] = ...) -> None: ...

class DiagnoseResponse(_message.Message):
    __slots__ = ("started", "progress", "round", "verdict")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    started: DiagnoseStarted
    progress: DiagnoseProgress
    round: _events_pb2.DiagnosisRound
    verdict: _events_pb2.DiagnosisVerdict
    def __init__(self, started: _Optional[_Union[DiagnoseStarted, _Mapping]] = ..., progress: _Optional[_Union[DiagnoseProgress, _Mapping]] = ..., round: _Optional[_Union[_events_pb2.DiagnosisRound, _Mapping]] = ..., verdict: _Optional[_Union[_events_pb2.DiagnosisVerdict, _Mapping]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("seq", "from_phase", "phase")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    from_phase: str
    phase: str
    def __init__(self, seq: _Optional[int] = ..., from_phase: _Optional[str] = ..., phase: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("node_id", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("seq", "agent_notified", "recovering")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AGENT_NOTIFIED_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    agent_notified: bool
    recovering: bool
    def __init__(self, seq: _Optional[int] = ..., agent_notified: _Optional[bool] = ..., recovering: _Optional[bool] = ...) -> None: ...

class ClearNodeRequest(_message.Message):
    __slots__ = ("node_id", "force")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    force: bool
    def __init__(self, node_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ClearNodeResponse(_message.Message):
    __slots__ = ("seq", "answer", "scheduler")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    seq: int
    answer: str
    scheduler: str
    def __init__(self, seq: _Optional[int] = ..., answer: _Optional[str] = ..., scheduler: _Optional[str] = ...) -> None: ...

class RunSelfCheckRequest(_message.Message):
    __slots__ = ("node_ids", "timeout_s")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class NodeSelfCheck(_message.Message):
    __slots__ = ("node_id", "ok", "failures", "details_json", "error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    ok: bool
    failures: _containers.RepeatedScalarFieldContainer[str]
    details_json: str
    error: str
    def __init__(self, node_id: _Optional[str] = ..., ok: _Optional[bool] = ..., failures: _Optional[_Iterable[str]] = ..., details_json: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class RunSelfCheckResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[NodeSelfCheck]
    def __init__(self, results: _Optional[_Iterable[_Union[NodeSelfCheck, _Mapping]]] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("node_id", "kind", "local_rank", "factor", "step", "sdc")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SDC_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: str
    local_rank: int
    factor: float
    step: int
    sdc: SdcFault
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[str] = ..., local_rank: _Optional[int] = ..., factor: _Optional[float] = ..., step: _Optional[int] = ..., sdc: _Optional[_Union[SdcFault, _Mapping]] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ("seq", "ok", "detail")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ok: bool
    detail: str
    def __init__(self, seq: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class LiveViewRequest(_message.Message):
    __slots__ = ("summary_only", "page_size", "after")
    SUMMARY_ONLY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    summary_only: bool
    page_size: int
    after: str
    def __init__(self, summary_only: _Optional[bool] = ..., page_size: _Optional[int] = ..., after: _Optional[str] = ...) -> None: ...

class LiveStats(_message.Message):
    __slots__ = ("heartbeats", "nodes_alive", "nodes_lost", "events_appended", "delivery_p50_ms", "delivery_p99_ms", "handler_p50_us", "handler_p99_us", "samples", "alerts_coalesced", "alerts_shed", "faults_pending")
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    NODES_ALIVE_FIELD_NUMBER: _ClassVar[int]
    NODES_LOST_FIELD_NUMBER: _ClassVar[int]
    EVENTS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_P50_MS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_P99_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_P50_US_FIELD_NUMBER: _ClassVar[int]
    HANDLER_P99_US_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ALERTS_COALESCED_FIELD_NUMBER: _ClassVar[int]
    ALERTS_SHED_FIELD_NUMBER: _ClassVar[int]
    FAULTS_PENDING_FIELD_NUMBER: _ClassVar[int]
    heartbeats: int
    nodes_alive: int
    nodes_lost: int
    events_appended: int
    delivery_p50_ms: float
    delivery_p99_ms: float
    handler_p50_us: float
    handler_p99_us: float
    samples: int
    alerts_coalesced: int
    alerts_shed: int
    faults_pending: int
    def __init__(self, heartbeats: _Optional[int] = ..., nodes_alive: _Optional[int] = ..., nodes_lost: _Optional[int] = ..., events_appended: _Optional[int] = ..., delivery_p50_ms: _Optional[float] = ..., delivery_p99_ms: _Optional[float] = ..., handler_p50_us: _Optional[float] = ..., handler_p99_us: _Optional[float] = ..., samples: _Optional[int] = ..., alerts_coalesced: _Optional[int] = ..., alerts_shed: _Optional[int] = ..., faults_pending: _Optional[int] = ...) -> None: ...

class NodeLive(_message.Message):
    __slots__ = ("node_id", "epoch", "alive", "silent_ms", "heartbeats", "workers", "host", "attached")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    alive: bool
    silent_ms: float
    heartbeats: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    host: HostStats
    attached: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., alive: _Optional[bool] = ..., silent_ms: _Optional[float] = ..., heartbeats: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., host: _Optional[_Union[HostStats, _Mapping]] = ..., attached: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class LiveViewResponse(_message.Message):
    __slots__ = ("driver_id", "leader", "nodes", "stats", "next_after")
    DRIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NEXT_AFTER_FIELD_NUMBER: _ClassVar[int]
    driver_id: str
    leader: bool
    nodes: _containers.RepeatedCompositeFieldContainer[NodeLive]
    stats: LiveStats
    next_after: str
    def __init__(self, driver_id: _Optional[str] = ..., leader: _Optional[bool] = ..., nodes: _Optional[_Iterable[_Union[NodeLive, _Mapping]]] = ..., stats: _Optional[_Union[LiveStats, _Mapping]] = ..., next_after: _Optional[str] = ...) -> None: ...

class RegisterJobRequest(_message.Message):
    __slots__ = ("trainer", "world", "min_nodes", "max_nodes", "config_json")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    world: _events_pb2.WorldLayout
    min_nodes: int
    max_nodes: int
    config_json: str
    def __init__(self, trainer: _Optional[str] = ..., world: _Optional[_Union[_events_pb2.WorldLayout, _Mapping]] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., config_json: _Optional[str] = ...) -> None: ...

class RegisterJobResponse(_message.Message):
    __slots__ = ("job_id", "seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("kind", "node_id", "local_rank", "global_rank", "exit_code", "last_step", "reason", "report_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    kind: FailureKind
    node_id: str
    local_rank: int
    global_rank: int
    exit_code: int
    last_step: int
    reason: str
    report_id: str
    def __init__(self, kind: _Optional[_Union[FailureKind, str]] = ..., node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., last_step: _Optional[int] = ..., reason: _Optional[str] = ..., report_id: _Optional[str] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("seq", "event_kind")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_KIND_FIELD_NUMBER: _ClassVar[int]
    seq: int
    event_kind: str
    def __init__(self, seq: _Optional[int] = ..., event_kind: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("skip_shards",)
    SKIP_SHARDS_FIELD_NUMBER: _ClassVar[int]
    skip_shards: bool
    def __init__(self, skip_shards: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("rank", "uri", "bytes", "node_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    uri: str
    bytes: int
    node_id: str
    def __init__(self, rank: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("step", "seq", "wall_time_unix_ns", "uri", "bytes", "ranks", "shards", "shards_error", "checksum", "pruned", "verified")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PRUNED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    seq: int
    wall_time_unix_ns: int
    uri: str
    bytes: int
    ranks: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardInfo]
    shards_error: str
    checksum: str
    pruned: bool
    verified: bool
    def __init__(self, step: _Optional[int] = ..., seq: _Optional[int] = ..., wall_time_unix_ns: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., ranks: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardInfo, _Mapping]]] = ..., shards_error: _Optional[str] = ..., checksum: _Optional[str] = ..., pruned: _Optional[bool] = ..., verified: _Optional[bool] = ...) -> None: ...

class NodeFlashInfo(_message.Message):
    __slots__ = ("node_id", "persisted_step", "ranks", "live_step")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    persisted_step: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    live_step: int
    def __init__(self, node_id: _Optional[str] = ..., persisted_step: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., live_step: _Optional[int] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "nodes", "verified_steps")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeFlashInfo]
    verified_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeFlashInfo, _Mapping]]] = ..., verified_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestCheckpointRequest(_message.Message):
    __slots__ = ("wait", "timeout_s", "lead_steps")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEAD_STEPS_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    timeout_s: float
    lead_steps: int
    def __init__(self, wait: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., lead_steps: _Optional[int] = ...) -> None: ...

class RequestCheckpointResponse(_message.Message):
    __slots__ = ("step", "node_ids", "seq", "committed_step", "uri")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    step: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    seq: int
    committed_step: int
    uri: str
    def __init__(self, step: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., seq: _Optional[int] = ..., committed_step: _Optional[int] = ..., uri: _Optional[str] = ...) -> None: ...
