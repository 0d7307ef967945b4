from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_1: _ClassVar[SchemaVersion]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_STARTING: _ClassVar[Phase]
    PHASE_RUNNING: _ClassVar[Phase]
    PHASE_SUSPECTED: _ClassVar[Phase]
    PHASE_PAUSED: _ClassVar[Phase]
    PHASE_DIAGNOSED: _ClassVar[Phase]
    PHASE_RESHAPED: _ClassVar[Phase]
    PHASE_RESTORING: _ClassVar[Phase]
    PHASE_FINISHED: _ClassVar[Phase]
    PHASE_FAILED: _ClassVar[Phase]

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_ACTIVE: _ClassVar[NodeState]
    NODE_STATE_SPARE: _ClassVar[NodeState]
    NODE_STATE_LOST: _ClassVar[NodeState]
    NODE_STATE_EVICTED: _ClassVar[NodeState]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_1: SchemaVersion
PHASE_UNSPECIFIED: Phase
PHASE_STARTING: Phase
PHASE_RUNNING: Phase
PHASE_SUSPECTED: Phase
PHASE_PAUSED: Phase
PHASE_DIAGNOSED: Phase
PHASE_RESHAPED: Phase
PHASE_RESTORING: Phase
PHASE_FINISHED: Phase
PHASE_FAILED: Phase
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_ACTIVE: NodeState
NODE_STATE_SPARE: NodeState
NODE_STATE_LOST: NodeState
NODE_STATE_EVICTED: NodeState

class Event(_message.Message):
    __slots__ = ("seq", "event_id", "wall_time_unix_ns", "job_id", "schema_version", "cause", "writer", "job_started", "node_registered", "node_lost", "worker_failed", "hang_suspected", "log_alert", "diagnosis_round", "diagnosis_verdict", "node_evicted", "spare_assigned", "world_resized", "checkpoint_committed", "restore_started", "restore_finished", "loss_spike", "rollback", "training_paused", "training_resumed", "leader_elected", "recovery_transition", "node_refused", "self_check_reported", "job_finished", "operator_action", "rendezvous_round", "rendezvous_refused", "scheduler_call", "straggler_suspected", "training_stepping", "world_nodes", "sdc_suspected", "step_verified", "replica_ready", "node_wait_expired")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    JOB_STARTED_FIELD_NUMBER: _ClassVar[int]
    NODE_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    NODE_LOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_FAILED_FIELD_NUMBER: _ClassVar[int]
    HANG_SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    LOG_ALERT_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSIS_ROUND_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSIS_VERDICT_FIELD_NUMBER: _ClassVar[int]
    NODE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    SPARE_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    WORLD_RESIZED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STARTED_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SPIKE_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    TRAINING_PAUSED_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RESUMED_FIELD_NUMBER: _ClassVar[int]
    LEADER_ELECTED_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_TRANSITION_FIELD_NUMBER: _ClassVar[int]
    NODE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SELF_CHECK_REPORTED_FIELD_NUMBER: _ClassVar[int]
    JOB_FINISHED_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_ACTION_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ROUND_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CALL_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    TRAINING_STEPPING_FIELD_NUMBER: _ClassVar[int]
    WORLD_NODES_FIELD_NUMBER: _ClassVar[int]
    SDC_SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    STEP_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_READY_FIELD_NUMBER: _ClassVar[int]
    NODE_WAIT_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    event_id: str
    wall_time_unix_ns: int
    job_id: str
    schema_version: int
    cause: str
    writer: str
    job_started: JobStarted
    node_registered: NodeRegistered
    node_lost: NodeLost
    worker_failed: WorkerFailed
    hang_suspected: HangSuspected
    log_alert: LogAlert
    diagnosis_round: DiagnosisRound
    diagnosis_verdict: DiagnosisVerdict
    node_evicted: NodeEvicted
    spare_assigned: SpareAssigned
    world_resized: WorldResized
    checkpoint_committed: CheckpointCommitted
    restore_started: RestoreStarted
    restore_finished: RestoreFinished
    loss_spike: LossSpike
    rollback: Rollback
    training_paused: TrainingPaused
    training_resumed: TrainingResumed
    leader_elected: LeaderElected
    recovery_transition: RecoveryTransition
    node_refused: NodeRefused
    self_check_reported: SelfCheckReported
    job_finished: JobFinished
    operator_action: OperatorAction
    rendezvous_round: RendezvousRound
    rendezvous_refused: RendezvousRefused
    scheduler_call: SchedulerCall
    straggler_suspected: StragglerSuspected
    training_stepping: TrainingStepping
    world_nodes: WorldNodes
    sdc_suspected: SdcSuspected
    step_verified: StepVerified
    replica_ready: ReplicaReady
    node_wait_expired: NodeWaitExpired
    def __init__(self, seq: _Optional[int] = ..., event_id: _Optional[str] = ..., wall_time_unix_ns: _Optional[int] = ..., job_id: _Optional[str] = ..., schema_version: _Optional[int] = ..., cause: _Optional[str] = ..., writer: _Optional[str] = ..., job_started: _Optional[_Union[JobStarted, _Mapping]] = ..., node_registered: _Optional[_Union[NodeRegistered, _Mapping]] = ..., node_lost: _Optional[_Union[NodeLost, _Mapping]] = ..., worker_failed: _Optional[_Union[WorkerFailed, _Mapping]] = ..., hang_suspected: _Optional[_Union[HangSuspected, _Mapping]] = ..., log_alert: _Optional[_Union[LogAlert, _Mapping]] = ..., diagnosis_round: _Optional[_Union[DiagnosisRound, _Mapping]] = ..., diagnosis_verdict: _Optional[_Union[DiagnosisVerdict, _Mapping]] = ..., node_evicted: _Optional[_Union[NodeEvicted, _Mapping]] = ..., spare_assigned: _Optional[_Union[SpareAssigned, _Mapping]] = ..., world_resized: _Optional[_Union[WorldResized, _Mapping]] = ..., checkpoint_committed: _Optional[_Union[CheckpointCommitted, _Mapping]] = ..., restore_started: _Optional[_Union[RestoreStarted, _Mapping]] = ..., restore_finished: _Optional[_Union[RestoreFinished, _Mapping]] = ..., loss_spike: _Optional[_Union[LossSpike, _Mapping]] = ..., rollback: _Optional[_Union[Rollback, _Mapping]] = ..., training_paused: _Optional[_Union[TrainingPaused, _Mapping]] = ..., training_resumed: _Optional[_Union[TrainingResumed, _Mapping]] = ..., leader_elected: _Optional[_Union[LeaderElected, _Mapping]] = ..., recovery_transition: _Optional[_Union[RecoveryTransition, _Mapping]] = ..., node_refused: _Optional[_Union[NodeRefused, _Mapping]] = ..., self_check_reported: _Optional[_Union[SelfCheckReported, _Mapping]] = ..., job_finished: _Optional[_Union[JobFinished, _Mapping]] = ..., operator_action: _Optional[_Union[OperatorAction, _Mapping]] = ..., rendezvous_round: _Optional[_Union[RendezvousRound, _Mapping]] = ..., rendezvous_refused: _Optional[_Union[RendezvousRefused, _Mapping]] = ..., scheduler_call: _Optional[_Union[SchedulerCall, _Mapping]] = ..., straggler_suspected: _Optional[_Union[StragglerSuspected, _Mapping]] = ..., training_stepping: _Optional[_Union[TrainingStepping, _Mapping]] = ..., world_nodes: _Optional[_Union[WorldNodes, _Mapping]] = ..., sdc_suspected: _Optional[_Union[SdcSuspected, _Mapping]] = ..., step_verified: _Optional[_Union[StepVerified, _Mapping]] = ..., replica_ready: _Optional[_Union[ReplicaReady, _Mapping]] = ..., node_wait_expired: _Optional[_Union[NodeWaitExpired, _Mapping]] = ...) -> None: ...

class RankFingerprint(_message.Message):
    __slots__ = ("step", "keys", "hashes", "global_rank")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    step: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    global_rank: int
    def __init__(self, step: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., hashes: _Optional[_Iterable[int]] = ..., global_rank: _Optional[int] = ...) -> None: ...

class SdcSuspected(_message.Message):
    __slots__ = ("step", "suspect_ranks", "suspect_nodes", "resolved", "keys", "verified_step", "detail", "memory_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_RANKS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_NODES_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_STEP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    suspect_ranks: _containers.RepeatedScalarFieldContainer[int]
    suspect_nodes: _containers.RepeatedScalarFieldContainer[str]
    resolved: bool
    keys: _containers.RepeatedScalarFieldContainer[str]
    verified_step: int
    detail: str
    memory_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., suspect_ranks: _Optional[_Iterable[int]] = ..., suspect_nodes: _Optional[_Iterable[str]] = ..., resolved: _Optional[bool] = ..., keys: _Optional[_Iterable[str]] = ..., verified_step: _Optional[int] = ..., detail: _Optional[str] = ..., memory_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class StepVerified(_message.Message):
    __slots__ = ("step", "ranks", "groups", "buddy_checked")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BUDDY_CHECKED_FIELD_NUMBER: _ClassVar[int]
    step: int
    ranks: int
    groups: int
    buddy_checked: int
    def __init__(self, step: _Optional[int] = ..., ranks: _Optional[int] = ..., groups: _Optional[int] = ..., buddy_checked: _Optional[int] = ...) -> None: ...

class ReplicaReady(_message.Message):
    __slots__ = ("node_ids", "reason")
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class NodeWaitExpired(_message.Message):
    __slots__ = ("incident_id", "waited_s", "reason")
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    incident_id: str
    waited_s: float
    reason: str
    def __init__(self, incident_id: _Optional[str] = ..., waited_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JobStarted(_message.Message):
    __slots__ = ("trainer", "world", "min_nodes", "max_nodes", "config_json", "reports_startup")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    REPORTS_STARTUP_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    world: WorldLayout
    min_nodes: int
    max_nodes: int
    config_json: str
    reports_startup: bool
    def __init__(self, trainer: _Optional[str] = ..., world: _Optional[_Union[WorldLayout, _Mapping]] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., config_json: _Optional[str] = ..., reports_startup: _Optional[bool] = ...) -> None: ...

class NodeRegistered(_message.Message):
    __slots__ = ("node_id", "epoch", "hostname", "ip", "pod_name", "num_workers", "num_gpus", "agent_version", "spare", "replica_buddy", "replica_pubkey")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    POD_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDDY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    hostname: str
    ip: str
    pod_name: str
    num_workers: int
    num_gpus: int
    agent_version: str
    spare: bool
    replica_buddy: str
    replica_pubkey: bytes
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., hostname: _Optional[str] = ..., ip: _Optional[str] = ..., pod_name: _Optional[str] = ..., num_workers: _Optional[int] = ..., num_gpus: _Optional[int] = ..., agent_version: _Optional[str] = ..., spare: _Optional[bool] = ..., replica_buddy: _Optional[str] = ..., replica_pubkey: _Optional[bytes] = ...) -> None: ...

class NodeLost(_message.Message):
    __slots__ = ("node_id", "epoch", "silent_ms", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    silent_ms: float
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., silent_ms: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerFailed(_message.Message):
    __slots__ = ("node_id", "local_rank", "global_rank", "exit_code", "last_step", "silent_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    local_rank: int
    global_rank: int
    exit_code: int
    last_step: int
    silent_ms: float
    def __init__(self, node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., exit_code: _Optional[int] = ..., last_step: _Optional[int] = ..., silent_ms: _Optional[float] = ...) -> None: ...

class HangSuspected(_message.Message):
    __slots__ = ("node_id", "local_rank", "global_rank", "stuck_at_step", "silent_ms", "threshold_ms", "stack_dump", "phase", "hung_ranks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_RANK_FIELD_NUMBER: _ClassVar[int]
    STUCK_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_MS_FIELD_NUMBER: _ClassVar[int]
    STACK_DUMP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    HUNG_RANKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    local_rank: int
    global_rank: int
    stuck_at_step: int
    silent_ms: float
    threshold_ms: float
    stack_dump: str
    phase: str
    hung_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., global_rank: _Optional[int] = ..., stuck_at_step: _Optional[int] = ..., silent_ms: _Optional[float] = ..., threshold_ms: _Optional[float] = ..., stack_dump: _Optional[str] = ..., phase: _Optional[str] = ..., hung_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class StragglerSuspected(_message.Message):
    __slots__ = ("node_id", "slowdown", "compute_ms", "others_ms", "wait_ms", "others_wait_ms", "z", "window_steps", "policy", "evidence", "compute_slowdown")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    OTHERS_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    OTHERS_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    Z_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    slowdown: float
    compute_ms: float
    others_ms: float
    wait_ms: float
    others_wait_ms: float
    z: float
    window_steps: int
    policy: str
    evidence: str
    compute_slowdown: float
    def __init__(self, node_id: _Optional[str] = ..., slowdown: _Optional[float] = ..., compute_ms: _Optional[float] = ..., others_ms: _Optional[float] = ..., wait_ms: _Optional[float] = ..., others_wait_ms: _Optional[float] = ..., z: _Optional[float] = ..., window_steps: _Optional[int] = ..., policy: _Optional[str] = ..., evidence: _Optional[str] = ..., compute_slowdown: _Optional[float] = ...) -> None: ...

class LogAlert(_message.Message):
    __slots__ = ("node_id", "local_rank", "keyword", "line", "repeats")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    KEYWORD_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    local_rank: int
    keyword: str
    line: str
    repeats: int
    def __init__(self, node_id: _Optional[str] = ..., local_rank: _Optional[int] = ..., keyword: _Optional[str] = ..., line: _Optional[str] = ..., repeats: _Optional[int] = ...) -> None: ...

class GroupResult(_message.Message):
    __slots__ = ("node_ids", "ok", "failure", "matmul_ms", "allgather_ms", "total_ms", "per_node_ms")
    class PerNodeMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MATMUL_MS_FIELD_NUMBER: _ClassVar[int]
    ALLGATHER_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PER_NODE_MS_FIELD_NUMBER: _ClassVar[int]
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    ok: bool
    failure: str
    matmul_ms: float
    allgather_ms: float
    total_ms: float
    per_node_ms: _containers.ScalarMap[str, float]
    def __init__(self, node_ids: _Optional[_Iterable[str]] = ..., ok: _Optional[bool] = ..., failure: _Optional[str] = ..., matmul_ms: _Optional[float] = ..., allgather_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., per_node_ms: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DiagnosisRound(_message.Message):
    __slots__ = ("diagnosis_id", "round", "groups")
    DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    diagnosis_id: str
    round: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupResult]
    def __init__(self, diagnosis_id: _Optional[str] = ..., round: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupResult, _Mapping]]] = ...) -> None: ...

class DiagnosisVerdict(_message.Message):
    __slots__ = ("diagnosis_id", "bad_nodes", "slow_nodes", "confirmed_directly", "rounds", "checks", "wall_s")
    DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    BAD_NODES_FIELD_NUMBER: _ClassVar[int]
    SLOW_NODES_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_DIRECTLY_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    diagnosis_id: str
    bad_nodes: _containers.RepeatedScalarFieldContainer[str]
    slow_nodes: _containers.RepeatedScalarFieldContainer[str]
    confirmed_directly: _containers.RepeatedScalarFieldContainer[str]
    rounds: int
    checks: int
    wall_s: float
    def __init__(self, diagnosis_id: _Optional[str] = ..., bad_nodes: _Optional[_Iterable[str]] = ..., slow_nodes: _Optional[_Iterable[str]] = ..., confirmed_directly: _Optional[_Iterable[str]] = ..., rounds: _Optional[int] = ..., checks: _Optional[int] = ..., wall_s: _Optional[float] = ...) -> None: ...

class NodeEvicted(_message.Message):
    __slots__ = ("node_id", "reason", "diagnosis_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    diagnosis_id: str
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., diagnosis_id: _Optional[str] = ...) -> None: ...

class SpareAssigned(_message.Message):
    __slots__ = ("spare_node_id", "replaces_node_id")
    SPARE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLACES_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    spare_node_id: str
    replaces_node_id: str
    def __init__(self, spare_node_id: _Optional[str] = ..., replaces_node_id: _Optional[str] = ...) -> None: ...

class WorldLayout(_message.Message):
    __slots__ = ("dp", "pp", "tp", "node_ids", "workers_per_node")
    DP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    dp: int
    pp: int
    tp: int
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    workers_per_node: int
    def __init__(self, dp: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ..., node_ids: _Optional[_Iterable[str]] = ..., workers_per_node: _Optional[int] = ...) -> None: ...

class WorldNodes(_message.Message):
    __slots__ = ("of", "node_ids")
    OF_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    of: str
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, of: _Optional[str] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorldResized(_message.Message):
    __slots__ = ("old_world", "new_world", "reason")
    OLD_WORLD_FIELD_NUMBER: _ClassVar[int]
    NEW_WORLD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    old_world: WorldLayout
    new_world: WorldLayout
    reason: str
    def __init__(self, old_world: _Optional[_Union[WorldLayout, _Mapping]] = ..., new_world: _Optional[_Union[WorldLayout, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class CheckpointCommitted(_message.Message):
    __slots__ = ("step", "uri", "bytes", "ranks", "checksum", "world", "persist_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PERSIST_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    uri: str
    bytes: int
    ranks: int
    checksum: str
    world: WorldLayout
    persist_s: float
    def __init__(self, step: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., ranks: _Optional[int] = ..., checksum: _Optional[str] = ..., world: _Optional[_Union[WorldLayout, _Mapping]] = ..., persist_s: _Optional[float] = ...) -> None: ...

class RestoreStarted(_message.Message):
    __slots__ = ("step", "source_by_rank", "reshard", "source_default")
    class SourceByRankEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BY_RANK_FIELD_NUMBER: _ClassVar[int]
    RESHARD_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    step: int
    source_by_rank: _containers.ScalarMap[int, str]
    reshard: bool
    source_default: str
    def __init__(self, step: _Optional[int] = ..., source_by_rank: _Optional[_Mapping[int, str]] = ..., reshard: _Optional[bool] = ..., source_default: _Optional[str] = ...) -> None: ...

class RestoreFinished(_message.Message):
    __slots__ = ("step", "duration_s", "ok", "error", "restored_step", "storage_ranks", "trained_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    STORAGE_RANKS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    duration_s: float
    ok: bool
    error: str
    restored_step: int
    storage_ranks: int
    trained_s: float
    def __init__(self, step: _Optional[int] = ..., duration_s: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., restored_step: _Optional[int] = ..., storage_ranks: _Optional[int] = ..., trained_s: _Optional[float] = ...) -> None: ...

class LossSpike(_message.Message):
    __slots__ = ("step", "loss", "baseline", "factor", "non_finite", "memory_steps")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    baseline: float
    factor: float
    non_finite: bool
    memory_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., baseline: _Optional[float] = ..., factor: _Optional[float] = ..., non_finite: _Optional[bool] = ..., memory_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("from_step", "to_step", "skip_batches", "reason", "skip_from_step", "diagnose_nodes")
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    SKIP_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SKIP_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSE_NODES_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    to_step: int
    skip_batches: int
    reason: str
    skip_from_step: int
    diagnose_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, from_step: _Optional[int] = ..., to_step: _Optional[int] = ..., skip_batches: _Optional[int] = ..., reason: _Optional[str] = ..., skip_from_step: _Optional[int] = ..., diagnose_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class TrainingPaused(_message.Message):
    __slots__ = ("reason", "at_step", "restore_step")
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    reason: str
    at_step: int
    restore_step: int
    def __init__(self, reason: _Optional[str] = ..., at_step: _Optional[int] = ..., restore_step: _Optional[int] = ...) -> None: ...

class TrainingResumed(_message.Message):
    __slots__ = ("at_step", "world", "planned_step", "mode")
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PLANNED_STEP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    at_step: int
    world: WorldLayout
    planned_step: int
    mode: str
    def __init__(self, at_step: _Optional[int] = ..., world: _Optional[_Union[WorldLayout, _Mapping]] = ..., planned_step: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class TrainingStepping(_message.Message):
    __slots__ = ("step", "startup_s", "trained_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    TRAINED_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    startup_s: float
    trained_s: float
    def __init__(self, step: _Optional[int] = ..., startup_s: _Optional[float] = ..., trained_s: _Optional[float] = ...) -> None: ...

class LeaderElected(_message.Message):
    __slots__ = ("driver_id", "lease_id", "term", "address", "scope")
    DRIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    driver_id: str
    lease_id: int
    term: int
    address: str
    scope: str
    def __init__(self, driver_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., term: _Optional[int] = ..., address: _Optional[str] = ..., scope: _Optional[str] = ...) -> None: ...

class RecoveryTransition(_message.Message):
    __slots__ = ("from_phase", "to_phase", "incident_id", "reason", "suspects", "bad_nodes", "diagnose", "by_operator", "rearm", "mode", "replace_ranks", "sit_out", "awaiting_nodes")
    FROM_PHASE_FIELD_NUMBER: _ClassVar[int]
    TO_PHASE_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    BAD_NODES_FIELD_NUMBER: _ClassVar[int]
    DIAGNOSE_FIELD_NUMBER: _ClassVar[int]
    BY_OPERATOR_FIELD_NUMBER: _ClassVar[int]
    REARM_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_RANKS_FIELD_NUMBER: _ClassVar[int]
    SIT_OUT_FIELD_NUMBER: _ClassVar[int]
    AWAITING_NODES_FIELD_NUMBER: _ClassVar[int]
    from_phase: Phase
    to_phase: Phase
    incident_id: str
    reason: str
    suspects: _containers.RepeatedScalarFieldContainer[str]
    bad_nodes: _containers.RepeatedScalarFieldContainer[str]
    diagnose: bool
    by_operator: bool
    rearm: bool
    mode: str
    replace_ranks: _containers.RepeatedScalarFieldContainer[int]
    sit_out: _containers.RepeatedScalarFieldContainer[str]
    awaiting_nodes: str
    def __init__(self, from_phase: _Optional[_Union[Phase, str]] = ..., to_phase: _Optional[_Union[Phase, str]] = ..., incident_id: _Optional[str] = ..., reason: _Optional[str] = ..., suspects: _Optional[_Iterable[str]] = ..., bad_nodes: _Optional[_Iterable[str]] = ..., diagnose: _Optional[bool] = ..., by_operator: _Optional[bool] = ..., rearm: _Optional[bool] = ..., mode: _Optional[str] = ..., replace_ranks: _Optional[_Iterable[int]] = ..., sit_out: _Optional[_Iterable[str]] = ..., awaiting_nodes: _Optional[str] = ...) -> None: ...

class NodeRefused(_message.Message):
    __slots__ = ("node_id", "epoch", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SelfCheckReported(_message.Message):
    __slots__ = ("node_id", "ok", "failures", "details_json", "trigger")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    ok: bool
    failures: _containers.RepeatedScalarFieldContainer[str]
    details_json: str
    trigger: str
    def __init__(self, node_id: _Optional[str] = ..., ok: _Optional[bool] = ..., failures: _Optional[_Iterable[str]] = ..., details_json: _Optional[str] = ..., trigger: _Optional[str] = ...) -> None: ...

class JobFinished(_message.Message):
    __slots__ = ("step", "ok", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    ok: bool
    reason: str
    def __init__(self, step: _Optional[int] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class OperatorAction(_message.Message):
    __slots__ = ("action", "target", "who", "reason")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    WHO_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: str
    target: str
    who: str
    reason: str
    def __init__(self, action: _Optional[str] = ..., target: _Optional[str] = ..., who: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RendezvousRound(_message.Message):
    __slots__ = ("run_id", "round", "closed", "participants", "waiting", "spares")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    closed: bool
    participants: _containers.RepeatedScalarFieldContainer[str]
    waiting: _containers.RepeatedScalarFieldContainer[str]
    spares: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., closed: _Optional[bool] = ..., participants: _Optional[_Iterable[str]] = ..., waiting: _Optional[_Iterable[str]] = ..., spares: _Optional[_Iterable[str]] = ...) -> None: ...

class RendezvousRefused(_message.Message):
    __slots__ = ("run_id", "node_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    node_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SchedulerCall(_message.Message):
    __slots__ = ("action", "node_id", "ok", "detail", "reason", "scheduler", "duration_s")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    action: str
    node_id: str
    ok: bool
    detail: str
    reason: str
    scheduler: str
    duration_s: float
    def __init__(self, action: _Optional[str] = ..., node_id: _Optional[str] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., reason: _Optional[str] = ..., scheduler: _Optional[str] = ..., duration_s: _Optional[float] = ...) -> None: ...

class NodeRecord(_message.Message):
    __slots__ = ("node_id", "state", "epoch", "hostname", "ip", "num_workers", "registered_seq", "failures", "spare", "gone_seq", "replica_buddy", "fault_steps", "replica_pubkey")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    IP_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_SEQ_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    GONE_SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDDY_FIELD_NUMBER: _ClassVar[int]
    FAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_PUBKEY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: NodeState
    epoch: int
    hostname: str
    ip: str
    num_workers: int
    registered_seq: int
    failures: int
    spare: bool
    gone_seq: int
    replica_buddy: str
    fault_steps: _containers.RepeatedScalarFieldContainer[int]
    replica_pubkey: bytes
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[NodeState, str]] = ..., epoch: _Optional[int] = ..., hostname: _Optional[str] = ..., ip: _Optional[str] = ..., num_workers: _Optional[int] = ..., registered_seq: _Optional[int] = ..., failures: _Optional[int] = ..., spare: _Optional[bool] = ..., gone_seq: _Optional[int] = ..., replica_buddy: _Optional[str] = ..., fault_steps: _Optional[_Iterable[int]] = ..., replica_pubkey: _Optional[bytes] = ...) -> None: ...

class CheckpointRecord(_message.Message):
    __slots__ = ("step", "uri", "bytes", "seq", "world", "wall_time_unix_ns", "verified")
    STEP_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    step: int
    uri: str
    bytes: int
    seq: int
    world: WorldLayout
    wall_time_unix_ns: int
    verified: bool
    def __init__(self, step: _Optional[int] = ..., uri: _Optional[str] = ..., bytes: _Optional[int] = ..., seq: _Optional[int] = ..., world: _Optional[_Union[WorldLayout, _Mapping]] = ..., wall_time_unix_ns: _Optional[int] = ..., verified: _Optional[bool] = ...) -> None: ...

class JobState(_message.Message):
    __slots__ = ("job_id", "last_seq", "phase", "nodes", "world", "checkpoints", "step", "leader", "leader_term", "leader_scope", "incident_id", "incident_cause", "suspects", "event_counts", "skipped_batches", "trainer", "min_nodes", "max_nodes", "last_diagnosis_id", "bad_nodes", "needs_diagnosis", "restore_step", "configured_world", "incident_world", "restore_attempts", "rollback_to", "rollback_diagnose", "recovery_mode", "replace_ranks", "rollback_steps", "last_rollback_to", "gone_nodes", "pruned_nodes", "prune_mark", "last_skip_from", "last_skip_batches", "goodput", "persist_cost_s", "failed_restores", "finished_reason", "verified_steps", "sdc_suspected", "last_sdc_step", "sdc_by_node", "sitting_out", "awaiting_nodes")
    class NodesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: NodeRecord
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[NodeRecord, _Mapping]] = ...) -> None: ...
    class EventCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SdcByNodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    LEADER_SCOPE_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_ID_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    LAST_DIAGNOSIS_ID_FIELD_NUMBER: _ClassVar[int]
    BAD_NODES_FIELD_NUMBER: _ClassVar[int]
    NEEDS_DIAGNOSIS_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_WORLD_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_WORLD_FIELD_NUMBER: _ClassVar[int]
    RESTORE_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_TO_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_DIAGNOSE_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_MODE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_RANKS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROLLBACK_TO_FIELD_NUMBER: _ClassVar[int]
    GONE_NODES_FIELD_NUMBER: _ClassVar[int]
    PRUNED_NODES_FIELD_NUMBER: _ClassVar[int]
    PRUNE_MARK_FIELD_NUMBER: _ClassVar[int]
    LAST_SKIP_FROM_FIELD_NUMBER: _ClassVar[int]
    LAST_SKIP_BATCHES_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    PERSIST_COST_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_RESTORES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REASON_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SDC_SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_SDC_STEP_FIELD_NUMBER: _ClassVar[int]
    SDC_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    SITTING_OUT_FIELD_NUMBER: _ClassVar[int]
    AWAITING_NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    last_seq: int
    phase: Phase
    nodes: _containers.MessageMap[str, NodeRecord]
    world: WorldLayout
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointRecord]
    step: int
    leader: str
    leader_term: int
    leader_scope: str
    incident_id: str
    incident_cause: str
    suspects: _containers.RepeatedScalarFieldContainer[str]
    event_counts: _containers.ScalarMap[str, int]
    skipped_batches: int
    trainer: str
    min_nodes: int
    max_nodes: int
    last_diagnosis_id: str
    bad_nodes: _containers.RepeatedScalarFieldContainer[str]
    needs_diagnosis: bool
    restore_step: int
    configured_world: WorldLayout
    incident_world: WorldLayout
    restore_attempts: int
    rollback_to: int
    rollback_diagnose: _containers.RepeatedScalarFieldContainer[str]
    recovery_mode: str
    replace_ranks: _containers.RepeatedScalarFieldContainer[int]
    rollback_steps: _containers.RepeatedScalarFieldContainer[int]
    last_rollback_to: int
    gone_nodes: int
    pruned_nodes: int
    prune_mark: int
    last_skip_from: int
    last_skip_batches: int
    goodput: GoodputLedger
    persist_cost_s: float
    failed_restores: int
    finished_reason: str
    verified_steps: _containers.RepeatedScalarFieldContainer[int]
    sdc_suspected: int
    last_sdc_step: int
    sdc_by_node: _containers.ScalarMap[str, int]
    sitting_out: _containers.RepeatedScalarFieldContainer[str]
    awaiting_nodes: str
    def __init__(self, job_id: _Optional[str] = ..., last_seq: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., nodes: _Optional[_Mapping[str, NodeRecord]] = ..., world: _Optional[_Union[WorldLayout, _Mapping]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointRecord, _Mapping]]] = ..., step: _Optional[int] = ..., leader: _Optional[str] = ..., leader_term: _Optional[int] = ..., leader_scope: _Optional[str] = ..., incident_id: _Optional[str] = ..., incident_cause: _Optional[str] = ..., suspects: _Optional[_Iterable[str]] = ..., event_counts: _Optional[_Mapping[str, int]] = ..., skipped_batches: _Optional[int] = ..., trainer: _Optional[str] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., last_diagnosis_id: _Optional[str] = ..., bad_nodes: _Optional[_Iterable[str]] = ..., needs_diagnosis: _Optional[bool] = ..., restore_step: _Optional[int] = ..., configured_world: _Optional[_Union[WorldLayout, _Mapping]] = ..., incident_world: _Optional[_Union[WorldLayout, _Mapping]] = ..., restore_attempts: _Optional[int] = ..., rollback_to: _Optional[int] = ..., rollback_diagnose: _Optional[_Iterable[str]] = ..., recovery_mode: _Optional[str] = ..., replace_ranks: _Optional[_Iterable[int]] = ..., rollback_steps: _Optional[_Iterable[int]] = ..., last_rollback_to: _Optional[int] = ..., gone_nodes: _Optional[int] = ..., pruned_nodes: _Optional[int] = ..., prune_mark: _Optional[int] = ..., last_skip_from: _Optional[int] = ..., last_skip_batches: _Optional[int] = ..., goodput: _Optional[_Union[GoodputLedger, _Mapping]] = ..., persist_cost_s: _Optional[float] = ..., failed_restores: _Optional[int] = ..., finished_reason: _Optional[str] = ..., verified_steps: _Optional[_Iterable[int]] = ..., sdc_suspected: _Optional[int] = ..., last_sdc_step: _Optional[int] = ..., sdc_by_node: _Optional[_Mapping[str, int]] = ..., sitting_out: _Optional[_Iterable[str]] = ..., awaiting_nodes: _Optional[str] = ...) -> None: ...

class GoodputLedger(_message.Message):
    __slots__ = ("started_ns", "incident_began_ns", "incident_cause", "lost_s_by_cause", "steps_redone", "last_fault", "incidents", "storage_incidents", "lost_s_by_category", "segment_began_ns", "segment_category", "pending_detect_s", "running_since_ns", "startup_open", "resumed_before_s")
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
    STARTED_NS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_BEGAN_NS_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    LOST_S_BY_CAUSE_FIELD_NUMBER: _ClassVar[int]
    STEPS_REDONE_FIELD_NUMBER: _ClassVar[int]
    LAST_FAULT_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    LOST_S_BY_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BEGAN_NS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_CATEGORY_FIELD_NUMBER: _ClassVar[int]
    PENDING_DETECT_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_OPEN_FIELD_NUMBER: _ClassVar[int]
    RESUMED_BEFORE_S_FIELD_NUMBER: _ClassVar[int]
    started_ns: int
    incident_began_ns: int
    incident_cause: str
    lost_s_by_cause: _containers.ScalarMap[str, float]
    steps_redone: int
    last_fault: str
    incidents: int
    storage_incidents: int
    lost_s_by_category: _containers.ScalarMap[str, float]
    segment_began_ns: int
    segment_category: str
    pending_detect_s: float
    running_since_ns: int
    startup_open: bool
    resumed_before_s: float
    def __init__(self, started_ns: _Optional[int] = ..., incident_began_ns: _Optional[int] = ..., incident_cause: _Optional[str] = ..., lost_s_by_cause: _Optional[_Mapping[str, float]] = ..., steps_redone: _Optional[int] = ..., last_fault: _Optional[str] = ..., incidents: _Optional[int] = ..., storage_incidents: _Optional[int] = ..., lost_s_by_category: _Optional[_Mapping[str, float]] = ..., segment_began_ns: _Optional[int] = ..., segment_category: _Optional[str] = ..., pending_detect_s: _Optional[float] = ..., running_since_ns: _Optional[int] = ..., startup_open: _Optional[bool] = ..., resumed_before_s: _Optional[float] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("last_seq", "state", "wall_time_unix_ns", "parts", "state_deflated", "parts_deflated")
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    STATE_DEFLATED_FIELD_NUMBER: _ClassVar[int]
    PARTS_DEFLATED_FIELD_NUMBER: _ClassVar[int]
    last_seq: int
    state: JobState
    wall_time_unix_ns: int
    parts: int
    state_deflated: bytes
    parts_deflated: bool
    def __init__(self, last_seq: _Optional[int] = ..., state: _Optional[_Union[JobState, _Mapping]] = ..., wall_time_unix_ns: _Optional[int] = ..., parts: _Optional[int] = ..., state_deflated: _Optional[bytes] = ..., parts_deflated: _Optional[bool] = ...) -> None: ...

class ArchiveSegment(_message.Message):
    __slots__ = ("first_seq", "last_seq", "events")
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    first_seq: int
    last_seq: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...
