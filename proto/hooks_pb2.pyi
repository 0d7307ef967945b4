from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepReport(_message.Message):
    __slots__ = ("step", "loss", "step_time_ms", "timings_ms", "has_loss", "has_peak", "peak_loss", "peak_step", "steps")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOSS_FIELD_NUMBER: _ClassVar[int]
    HAS_PEAK_FIELD_NUMBER: _ClassVar[int]
    PEAK_LOSS_FIELD_NUMBER: _ClassVar[int]
    PEAK_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    loss: float
    step_time_ms: float
    timings_ms: _containers.ScalarMap[str, float]
    has_loss: bool
    has_peak: bool
    peak_loss: float
    peak_step: int
    steps: int
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., step_time_ms: _Optional[float] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., has_loss: _Optional[bool] = ..., has_peak: _Optional[bool] = ..., peak_loss: _Optional[float] = ..., peak_step: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("reply_socket", "stack_signal", "attach", "rank", "world_size", "restop_signal")
    REPLY_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STACK_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTOP_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    reply_socket: str
    stack_signal: bool
    attach: bool
    rank: int
    world_size: int
    restop_signal: bool
    def __init__(self, reply_socket: _Optional[str] = ..., stack_signal: _Optional[bool] = ..., attach: _Optional[bool] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., restop_signal: _Optional[bool] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node_id", "flash_root", "flash_job", "flash_node", "persist_url")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FLASH_ROOT_FIELD_NUMBER: _ClassVar[int]
    FLASH_JOB_FIELD_NUMBER: _ClassVar[int]
    FLASH_NODE_FIELD_NUMBER: _ClassVar[int]
    PERSIST_URL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    flash_root: str
    flash_job: str
    flash_node: str
    persist_url: str
    def __init__(self, node_id: _Optional[str] = ..., flash_root: _Optional[str] = ..., flash_job: _Optional[str] = ..., flash_node: _Optional[str] = ..., persist_url: _Optional[str] = ...) -> None: ...

class PhaseReport(_message.Message):
    __slots__ = ("name", "step", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    step: int
    source: str
    def __init__(self, name: _Optional[str] = ..., step: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("step", "keys", "hashes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("local_rank", "pid", "hello", "step", "phase", "fingerprint")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    hello: Hello
    step: StepReport
    phase: PhaseReport
    fingerprint: Fingerprint
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[StepReport, _Mapping]] = ..., phase: _Optional[_Union[PhaseReport, _Mapping]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("command_id", "pause", "resume", "flash_save", "welcome", "stop", "hold", "rejoin")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FLASH_SAVE_FIELD_NUMBER: _ClassVar[int]
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    pause: str
    resume: int
    flash_save: int
    welcome: Welcome
    stop: str
    hold: str
    rejoin: Rejoin
    def __init__(self, command_id: _Optional[str] = ..., pause: _Optional[str] = ..., resume: _Optional[int] = ..., flash_save: _Optional[int] = ..., welcome: _Optional[_Union[Welcome, _Mapping]] = ..., stop: _Optional[str] = ..., hold: _Optional[str] = ..., rejoin: _Optional[_Union[Rejoin, _Mapping]] = ...) -> None: ...

class Rejoin(_message.Message):
    __slots__ = ("env", "unset")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENV_FIELD_NUMBER: _ClassVar[int]
    UNSET_FIELD_NUMBER: _ClassVar[int]
    env: _containers.ScalarMap[str, str]
    unset: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, env: _Optional[_Mapping[str, str]] = ..., unset: _Optional[_Iterable[str]] = ...) -> None: ...
