from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Caller(_message.Message):
    __slots__ = ("run_id", "node_id", "node_desc")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_DESC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    node_id: str
    node_desc: str
    def __init__(self, run_id: _Optional[str] = ..., node_id: _Optional[str] = ..., node_desc: _Optional[str] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("found", "state", "token")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    found: bool
    state: bytes
    token: int
    def __init__(self, found: _Optional[bool] = ..., state: _Optional[bytes] = ..., token: _Optional[int] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "complete", "closed", "participants", "waiting", "spares")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    round: int
    complete: bool
    closed: bool
    participants: _containers.RepeatedScalarFieldContainer[str]
    waiting: _containers.RepeatedScalarFieldContainer[str]
    spares: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., complete: _Optional[bool] = ..., closed: _Optional[bool] = ..., participants: _Optional[_Iterable[str]] = ..., waiting: _Optional[_Iterable[str]] = ..., spares: _Optional[_Iterable[str]] = ...) -> None: ...

class SetStateRequest(_message.Message):
    __slots__ = ("caller", "state", "token", "summary")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    state: bytes
    token: int
    summary: RoundSummary
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., state: _Optional[bytes] = ..., token: _Optional[int] = ..., summary: _Optional[_Union[RoundSummary, _Mapping]] = ...) -> None: ...

class SetStateResponse(_message.Message):
    __slots__ = ("ok", "state", "token")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    state: bytes
    token: int
    def __init__(self, ok: _Optional[bool] = ..., state: _Optional[bytes] = ..., token: _Optional[int] = ...) -> None: ...

class StoreSetRequest(_message.Message):
    __slots__ = ("caller", "key", "value")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    value: bytes
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class StoreSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreGetRequest(_message.Message):
    __slots__ = ("caller", "key", "wait_ms")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    wait_ms: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class StoreGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class StoreAddRequest(_message.Message):
    __slots__ = ("caller", "key", "delta")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    delta: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., delta: _Optional[int] = ...) -> None: ...

class StoreAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class StoreCompareSetRequest(_message.Message):
    __slots__ = ("caller", "key", "expected", "desired")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class StoreCompareSetResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class StoreWaitRequest(_message.Message):
    __slots__ = ("caller", "keys", "wait_ms")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    keys: _containers.RepeatedScalarFieldContainer[str]
    wait_ms: int
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class StoreWaitResponse(_message.Message):
    __slots__ = ("ready", "missing")
    READY_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ready: _Optional[bool] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class StoreCheckRequest(_message.Message):
    __slots__ = ("caller", "keys")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class StoreCheckResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class StoreDeleteRequest(_message.Message):
    __slots__ = ("caller", "key")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    key: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class StoreDeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StoreNumKeysRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class StoreNumKeysResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class GetKeyRequest(_message.Message):
    __slots__ = ("caller",)
    CALLER_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ...) -> None: ...

class GetKeyResponse(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...
