from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepReport(_message.Message):
    __slots__ = ("step", "loss", "step_time_ms", "timings_ms", "has_loss")
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
    step: int
    loss: float
    step_time_ms: float
    timings_ms: _containers.ScalarMap[str, float]
    has_loss: bool
    def __init__(self, step: _Optional[int] = ..., loss: _Optional[float] = ..., step_time_ms: _Optional[float] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., has_loss: _Optional[bool] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("reply_socket", "stack_signal")
    REPLY_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STACK_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    reply_socket: str
    stack_signal: bool
    def __init__(self, reply_socket: _Optional[str] = ..., stack_signal: _Optional[bool] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("local_rank", "pid", "hello", "step")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    pid: int
    hello: Hello
    step: StepReport
    def __init__(self, local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[StepReport, _Mapping]] = ...) -> None: ...

class WorkerCommand(_message.Message):
    __slots__ = ("command_id", "pause", "resume", "flash_save")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FLASH_SAVE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    pause: str
    resume: int
    flash_save: int
    def __init__(self, command_id: _Optional[str] = ..., pause: _Optional[str] = ..., resume: _Optional[int] = ..., flash_save: _Optional[int] = ...) -> None: ...
