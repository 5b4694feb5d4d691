"""msgpack codec for the dataclasses in shared.messages.

Wire form: a msgpack map {"v": VERSION, "t": type name, "d": fields}. Fields typed
`list[int]` (token ids, block ids) travel as packed little-endian int32 arrays, not as
lists of msgpack ints. Decoding is driven by the dataclass type hints, so a message is
defined once. Bad data raises CodecError (the reader ends that request, never its loop).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from typing import Any

import msgpack
import numpy as np

from shared import messages
from shared.messages import VERSION


class CodecError(ValueError):
    pass


_INT_LIST = list[int]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _to_wire(value: Any, hint: Any) -> Any:
    if hint == _INT_LIST and isinstance(value, list):
        return np.asarray(value, dtype="<i4").tobytes()
    if dataclasses.is_dataclass(value):
        hints = _hints(type(value))
        return {f.name: _to_wire(getattr(value, f.name), hints[f.name]) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        inner = args[0] if args and typing.get_origin(hint) is list else Any
        return [_to_wire(v, inner) for v in value]
    return value


def _from_wire(value: Any, hint: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _from_wire(value, inner[0]) if len(inner) == 1 else value
    if hint == _INT_LIST:
        if isinstance(value, bytes):
            if len(value) % 4:
                raise CodecError("packed int array has a length not a multiple of 4")
            return np.frombuffer(value, dtype="<i4").tolist()
        return [int(v) for v in value]
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise CodecError(f"{hint.__name__}: expected a map, got {type(value).__name__}")
        hints = _hints(hint)
        known = {f.name for f in dataclasses.fields(hint)}
        try:  # unknown fields are ignored so a newer writer can add fields
            return hint(**{k: _from_wire(v, hints[k]) for k, v in value.items() if k in known})
        except TypeError as e:
            raise CodecError(f"{hint.__name__}: {e}") from e
    if origin is list:
        (inner,) = typing.get_args(hint)
        return [_from_wire(v, inner) for v in value]
    if origin is tuple:
        return tuple(value)
    if origin is dict:
        return dict(value)
    return value


def pack(message: Any) -> bytes:
    return msgpack.packb({"v": VERSION, "t": type(message).__name__, "d": _to_wire(message, type(message))},
                         use_bin_type=True)


def unpack(data: bytes, expected: type | None = None) -> Any:
    try:
        envelope = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several types for garbage
        raise CodecError(f"not msgpack: {e}") from e
    if not isinstance(envelope, dict) or envelope.get("v") != VERSION:
        raise CodecError(f"unsupported message version: {envelope.get('v') if isinstance(envelope, dict) else '?'}")
    cls = getattr(messages, str(envelope.get("t")), None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise CodecError(f"unknown message type {envelope.get('t')!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected {expected.__name__}, got {cls.__name__}")
    return _from_wire(envelope.get("d"), cls)
