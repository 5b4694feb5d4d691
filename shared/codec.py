"""msgpack codec for the messages in pagedserve.shared.messages (dataclasses and msgspec Structs), on msgspec.

Wire form: a msgpack map {"v": VERSION, "t": type name, "d": the message's fields as a map}. msgspec
encodes both natively (the same map) and decodes straight into them, checking every field against its
type hint (ints where floats are declared are accepted, an integral float where an int is); a field
missing from the map takes its default, an unknown one is skipped (a newer writer may add fields).
Bad data raises CodecError (the reader ends that request, never its loop).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import msgspec

from pagedserve.shared import messages
from pagedserve.shared.messages import VERSION


class CodecError(ValueError):
    pass


class _Envelope(msgspec.Struct):
    v: int
    t: str
    d: msgspec.Raw  # decoded once the type is known, without parsing it twice


def _enc_hook(value: Any) -> Any:
    """numpy / torch scalars where ints or floats belong."""
    if hasattr(value, "__index__"):
        return value.__index__()
    if hasattr(value, "__float__"):
        return float(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_envelope = msgspec.msgpack.Decoder(_Envelope)


@functools.cache
def _decoder(cls: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls, strict=False)


@functools.cache
def _message_type(name: str) -> type | None:
    cls = getattr(messages, name, None)
    return cls if isinstance(cls, type) and (dataclasses.is_dataclass(cls) or issubclass(cls, msgspec.Struct)) else None


def pack(message: Any) -> bytes:
    return _encoder.encode({"v": VERSION, "t": type(message).__name__, "d": message})


def unpack(data: bytes, expected: type | None = None) -> Any:
    try:
        envelope = _envelope.decode(data)
    except msgspec.ValidationError as e:
        raise CodecError(f"not a message envelope: {e}") from e
    except msgspec.DecodeError as e:
        raise CodecError(f"not msgpack: {e}") from e
    if envelope.v != VERSION:
        raise CodecError(f"unsupported message version: {envelope.v}")
    cls = _message_type(envelope.t)
    if cls is None:
        raise CodecError(f"unknown message type {envelope.t!r}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected {expected.__name__}, got {cls.__name__}")
    try:
        return _decoder(cls).decode(envelope.d)
    except msgspec.MsgspecError as e:
        raise CodecError(f"{cls.__name__}: {e}") from e
