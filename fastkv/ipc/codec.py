"""A small schema codec for IPC messages: a fixed struct of scalars plus raw arrays,
strings and byte strings. Block ids travel as raw int32 bytes, never pickled.

A message class declares its wire schema as a string of ``name:kind`` fields and is
registered with a unique type id::

    @message(7)
    @dataclass(slots=True)
    class PingMsg:
        WIRE: ClassVar[str] = "seq:i64 note:str"
        seq: int
        note: str = ""

Field kinds: scalars ``i64 i32 f64 bool``; variable ``i32[] i64[]`` (numpy arrays),
``bytes str``, ``bytes[] str[]`` (sequences), ``i32[][]`` (a list of int32 arrays).
Adding a field changes the schema tag, so peers running different code versions fail
loudly (BadMessage) instead of misreading each other.

Wire format (little-endian; every section padded to 8 bytes so arrays decode aligned):

    u16 type id | u16 schema tag | u32 total length
    the scalars, packed in declaration order, padded to a multiple of 8
    per variable field, in declaration order:
        u32 count | u32 nbytes | nbytes of data | zero padding to 8
        i32[] / i64[]    count elements (nbytes = 4 or 8 * count)
        bytes / str      count = nbytes; str is UTF-8
        bytes[] / str[]  count items: count x u32 lengths, then the items back to back
        i32[][]          count arrays: (count + 1) x i32 offsets (offsets[0] = 0), then the values

Decoded arrays are read-only numpy views into the received bytes (no copy); copy them
to mutate.

The fast path is C (ops/ipc_codec.c): ``register`` hands it each schema once, then
``encode``/``decode`` and the batch forms ``encode_many``/``decode_many`` run without
Python code per message. ``encode_py``/``decode_py`` are the reference it is tested
against, and ``encode`` falls back to the Python path for values that need converting.
"""
from __future__ import annotations

import dataclasses
import operator
import struct
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fastkv.ipc.errors import BadMessage
from fastkv.ipc.native import C

_SCALARS = {"i64": "q", "i32": "i", "f64": "d", "bool": "?"}
_VARIABLE = ("i32[]", "i64[]", "bytes", "str", "bytes[]", "str[]", "i32[][]")
_HEAD = struct.Struct("<HHI")
_VAR = struct.Struct("<II")
_PAD = [b"\0" * i for i in range(8)]
_I32, _I64 = np.dtype("<i4"), np.dtype("<i8")
_I32N = np.dtype(np.int32)  # the native singleton: `dtype is _I32N` is a cheap exact test
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


class Schema:
    """The compiled wire schema of one message class."""

    def __init__(self, cls: type, type_id: int) -> None:
        self.cls, self.type_id = cls, type_id
        fields = [f.split(":") for f in cls.WIRE.split()]
        for name, kind in fields:
            if kind not in _SCALARS and kind not in _VARIABLE:
                raise ValueError(f"{cls.__name__}.{name}: unknown wire kind {kind!r}")
        self.names = [name for name, _ in fields]
        slots = list(getattr(cls, "__slots__", ()))
        if slots and slots != self.names:
            raise ValueError(f"{cls.__name__}: WIRE fields {self.names} must match the dataclass fields {slots}")
        self.scalar_idx = [i for i, (_, k) in enumerate(fields) if k in _SCALARS]
        self.var_idx = [i for i, (_, k) in enumerate(fields) if k in _VARIABLE]
        self.var = [(fields[i][0], *_CODERS[fields[i][1]], f"{cls.__name__}.{fields[i][0]}") for i in self.var_idx]
        self.in_order = self.scalar_idx == list(range(len(self.scalar_idx)))
        # for ops/ipc_codec.c: every field in declaration order as (name, kind code, "Class.name")
        self.c_fields = tuple((name, _KIND_CODES[kind], f"{cls.__name__}.{name}") for name, kind in fields)
        # cls(*values) only fills the slots: C may build instances without calling it
        self.fast_new = (dataclasses.is_dataclass(cls) and slots == self.names and cls.__new__ is object.__new__
                         and not hasattr(cls, "__post_init__") and all(f.init for f in dataclasses.fields(cls)))
        fmt = "<" + "".join(_SCALARS[fields[i][1]] for i in self.scalar_idx)
        size = struct.calcsize(fmt)
        self.scalars = struct.Struct(fmt + "x" * (-size % 8))
        names = [fields[i][0] for i in self.scalar_idx]
        if len(names) > 1:
            self.get_scalars = operator.attrgetter(*names)  # returns the tuple struct.pack wants
        else:
            self.get_scalars = lambda m: tuple(getattr(m, n) for n in names)
        self.tag = zlib.crc32(f"{cls.__name__}:{cls.WIRE}".encode()) & 0xFFFF


_BY_TYPE: dict[int, Schema] = {}
_BY_CLASS: dict[type, Schema] = {}


def message(type_id: int) -> Callable[[type], type]:
    """Class decorator registering a message type under ``type_id`` (1..65535)."""

    def register(cls: type) -> type:
        if not 1 <= type_id <= 0xFFFF or type_id in _BY_TYPE:
            raise ValueError(f"message type id {type_id} for {cls.__name__} is out of range or already taken")
        schema = Schema(cls, type_id)
        C.register(type_id, schema.tag, cls, schema.c_fields, schema.scalars.size, schema.fast_new)
        _BY_TYPE[type_id] = _BY_CLASS[cls] = schema
        cls.TYPE_ID = type_id
        return cls

    return register


def _i32(value: Any, where: str) -> np.ndarray:
    if type(value) is np.ndarray and value.dtype is _I32N and value.ndim == 1:
        return value  # the common case, checked cheaply
    a = np.asarray(value)
    if a.ndim != 1:
        raise ValueError(f"{where} must be one-dimensional, got shape {a.shape}")
    if a.dtype != _I32:
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"{where} must hold integers, got dtype {a.dtype}")
        if a.size and (int(a.min()) < _I32_MIN or int(a.max()) > _I32_MAX):
            raise ValueError(f"{where} has values outside int32")
        a = a.astype(_I32)
    return a


_U32S: dict[int, struct.Struct] = {}
_EMPTY_FIELD = b"\0" * 8  # count 0, nbytes 0


def _u32s(n: int) -> struct.Struct:
    s = _U32S.get(n)
    if s is None:
        s = _U32S[n] = struct.Struct(f"<{n}I")
    return s


def _tail(parts: list, count: int, data: Any, nbytes: int) -> int:
    parts.append(_VAR.pack(count, nbytes))
    parts.append(data)
    pad = -nbytes % 8
    if pad:
        parts.append(_PAD[pad])
    return 8 + nbytes + pad


def _enc_i32(value: Any, where: str, parts: list) -> int:
    data = _i32(value, where).tobytes()
    return _tail(parts, len(data) >> 2, data, len(data))


def _enc_i64(value: Any, where: str, parts: list) -> int:
    a = np.asarray(value)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise TypeError(f"{where} must be a one-dimensional integer array, got {a.dtype} {a.shape}")
    data = a.astype(_I64, copy=False).tobytes()
    return _tail(parts, len(data) >> 3, data, len(data))


def _enc_bytes(value: Any, where: str, parts: list) -> int:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"{where} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    return _tail(parts, len(value), value, len(value))


def _enc_str(value: Any, where: str, parts: list) -> int:
    if not isinstance(value, str):
        raise TypeError(f"{where} must be str, got {type(value).__name__}")
    data = value.encode()
    return _tail(parts, len(data), data, len(data))


def _enc_bytes_list(value: Any, where: str, parts: list, items: list | None = None) -> int:
    if items is None:
        if isinstance(value, str | bytes):
            raise TypeError(f"{where} must be a sequence of bytes, got a single {type(value).__name__}")
        items = value if type(value) is list or type(value) is tuple else list(value)
        for v in items:
            if type(v) is not bytes:
                raise TypeError(f"{where} must hold bytes, got {type(v).__name__}")
    n = len(items)
    if not n:
        parts.append(_EMPTY_FIELD)
        return 8
    data = _u32s(n).pack(*map(len, items)) + b"".join(items)
    return _tail(parts, n, data, len(data))


def _enc_str_list(value: Any, where: str, parts: list) -> int:
    if isinstance(value, str | bytes):
        raise TypeError(f"{where} must be a sequence of str, got a single {type(value).__name__}")
    for v in value:
        if type(v) is not str:
            raise TypeError(f"{where} must hold str, got {type(v).__name__}")
    return _enc_bytes_list(value, where, parts, [v.encode() for v in value])


def _enc_ragged(value: Any, where: str, parts: list) -> int:
    arrays = [_i32(v, where) for v in value]
    offsets = np.zeros(len(arrays) + 1, _I32)
    if arrays:
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
    data = offsets.tobytes() + (np.concatenate(arrays).astype(_I32, copy=False).tobytes() if arrays else b"")
    return _tail(parts, len(arrays), data, len(data))


def _dec_i32(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    if nbytes != 4 * count:
        raise _bad(buf, f"{where}: {count} elements but {nbytes} bytes")
    return np.frombuffer(buf, _I32N, count, off)


def _dec_i64(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    if nbytes != 8 * count:
        raise _bad(buf, f"{where}: {count} elements but {nbytes} bytes")
    return np.frombuffer(buf, _I64, count, off)


def _dec_bytes(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    if nbytes != count:
        raise _bad(buf, f"{where}: count {count} != nbytes {nbytes}")
    return buf[off:off + nbytes]


def _dec_str(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    raw = _dec_bytes(buf, off, count, nbytes, where)
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise _bad(buf, f"{where}: invalid UTF-8 ({exc})") from None


def _dec_bytes_list(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    if 4 * count > nbytes:
        raise _bad(buf, f"{where}: {count} lengths do not fit in {nbytes} bytes")
    lens = _u32s(count).unpack_from(buf, off) if count else ()
    if 4 * count + sum(lens) != nbytes:  # an empty list with bytes too (the C decoder's check)
        raise _bad(buf, f"{where}: item lengths do not add up to {nbytes} bytes")
    items, p = [], off + 4 * count
    for ln in lens:
        items.append(buf[p:p + ln])
        p += ln
    return tuple(items)


def _dec_str_list(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    try:
        return [b.decode() for b in _dec_bytes_list(buf, off, count, nbytes, where)]
    except UnicodeDecodeError as exc:
        raise _bad(buf, f"{where}: invalid UTF-8 ({exc})") from None


def _dec_ragged(buf: bytes, off: int, count: int, nbytes: int, where: str) -> Any:
    if 4 * (count + 1) > nbytes or nbytes % 4:
        raise _bad(buf, f"{where}: {count} offsets do not fit in {nbytes} bytes")
    offsets = np.frombuffer(buf, _I32, count + 1, off)
    values = np.frombuffer(buf, _I32, nbytes // 4 - count - 1, off + 4 * (count + 1))
    if offsets[0] != 0 or offsets[-1] != len(values) or (count and np.any(np.diff(offsets) < 0)):
        raise _bad(buf, f"{where}: offsets are not a non-decreasing 0..{len(values)} sequence")
    bounds = offsets.tolist()
    return [values[bounds[j]:bounds[j + 1]] for j in range(count)]


_KIND_CODES = {"i32[]": 1, "i64[]": 2, "bytes": 3, "str": 4, "bytes[]": 5, "str[]": 6, "i32[][]": 7,  # ops/ipc_codec.h
               "i64": 11, "i32": 12, "f64": 13, "bool": 14}
_CODERS = {
    "i32[]": (_enc_i32, _dec_i32),
    "i64[]": (_enc_i64, _dec_i64),
    "bytes": (_enc_bytes, _dec_bytes),
    "str": (_enc_str, _dec_str),
    "bytes[]": (_enc_bytes_list, _dec_bytes_list),
    "str[]": (_enc_str_list, _dec_str_list),
    "i32[][]": (_enc_ragged, _dec_ragged),
}


def encode(msg: Any) -> bytes:
    """The wire bytes of a registered message (TypeError for anything else). The C fast
    path takes canonical values (ints, floats, bools, int32 numpy arrays, bytes, str,
    lists/tuples of them); anything else goes through ``encode_py``, which converts or
    raises a clear error."""
    buf = C.encode(msg)
    return encode_py(msg) if buf is None else buf


def encode_many(msgs: Iterable[Any], accept: tuple[type, ...] | None = None,
                fallback: Callable[[Any], bytes] = encode) -> list[bytes]:
    """``[fallback(m) for m in msgs]`` in one C call: messages of a type in ``accept``
    (None: any registered type) with canonical values are encoded in C, every other one
    by ``fallback`` (which converts it or raises the error)."""
    return C.encode_many(msgs, accept, fallback)


def encode_py(msg: Any) -> bytes:
    """The pure-Python encoder: the reference the C fast path is tested against."""
    schema = _BY_CLASS.get(type(msg))
    if schema is None:
        raise TypeError(f"cannot encode {type(msg).__name__}: not a registered fastkv message type")
    try:
        scalars = schema.scalars.pack(*schema.get_scalars(msg))
    except struct.error as exc:
        raise ValueError(f"{type(msg).__name__}: bad scalar field ({exc})") from None
    return _encode_py(msg, schema, scalars)


def _encode_py(msg: Any, schema: Schema, scalars: bytes) -> bytes:
    parts = [b"", scalars]
    total = 8 + len(scalars)
    for name, enc, _, where in schema.var:
        total += enc(getattr(msg, name), where, parts)
    if total > 0xFFFFFFFF:
        raise ValueError(f"{type(msg).__name__} of {total} bytes is too large to encode")
    parts[0] = _HEAD.pack(schema.type_id, schema.tag, total)
    return b"".join(parts)


def _bad(buf: bytes, why: str) -> BadMessage:
    return BadMessage(f"bad message ({len(buf)} bytes): {why}")


def _header(buf: bytes) -> Schema:
    n = len(buf)
    if n < 8:
        raise _bad(buf, "shorter than the 8-byte header")
    type_id, tag, total = _HEAD.unpack_from(buf)
    schema = _BY_TYPE.get(type_id)
    if schema is None:
        raise _bad(buf, f"unknown message type id {type_id}")
    if tag != schema.tag:
        raise _bad(buf, f"{schema.cls.__name__} schema tag {tag:#x} != ours {schema.tag:#x} (peer runs other code)")
    if total != n:
        raise _bad(buf, f"{schema.cls.__name__} header says {total} bytes (truncated or trailing data)")
    if 8 + schema.scalars.size > n:
        raise _bad(buf, f"{schema.cls.__name__} truncated in its scalars")
    return schema


def _build(buf: bytes, schema: Schema, scalars: tuple, var: list) -> Any:
    values: list[Any] = [*scalars, *var]
    if not schema.in_order:
        values = [None] * len(schema.names)
        for i, v in zip(schema.scalar_idx, scalars, strict=True):
            values[i] = v
        for i, v in zip(schema.var_idx, var, strict=True):
            values[i] = v
    try:
        return schema.cls(*values)
    except ValueError as exc:  # the class's own validation (__post_init__): a bad message too
        raise _bad(buf, str(exc)) from None


def decode(buf: bytes) -> Any:
    """Parse wire bytes back into the registered message; BadMessage for anything
    malformed (unknown type, schema mismatch, truncated, trailing bytes, bad UTF-8)."""
    if type(buf) is not bytes:
        buf = bytes(buf)
    try:
        return C.decode(buf)
    except ValueError as exc:
        raise _bad(buf, str(exc)) from None


def decode_many(bufs: list[bytes], accept: tuple[type, ...] | None = None) -> tuple[list[Any], int, str | None]:
    """Decode in order, in one C call, up to the first bad buffer: returns (messages,
    index of the bad buffer or -1, why). ``why`` is the reason it is malformed (the text
    ``decode`` puts in its BadMessage), or None when it is a message of a type not in
    ``accept`` (None: any registered type)."""
    return C.decode_many(bufs if type(bufs) is list else list(bufs), accept)


def bad_message(buf: bytes, why: str) -> BadMessage:
    """The BadMessage ``decode`` raises for ``buf`` (``why`` from ``decode_many``)."""
    return _bad(buf, why)


def decode_py(buf: bytes) -> Any:
    """The pure-Python decoder: the reference the C fast path is tested against."""
    buf = bytes(buf)
    schema = _header(buf)
    n, off = len(buf), 8 + schema.scalars.size
    scalars = schema.scalars.unpack_from(buf, 8)
    var = []
    for _, _, dec, where in schema.var:
        if off + 8 > n:
            raise _bad(buf, f"{where}: truncated field header")
        count, nbytes = _VAR.unpack_from(buf, off)
        off += 8
        end = off + nbytes
        if end > n:
            raise _bad(buf, f"{where}: {nbytes} bytes run past the end")
        var.append(dec(buf, off, count, nbytes, where))
        off = end + (-nbytes % 8)
    if off != n:
        raise _bad(buf, f"{schema.cls.__name__}: {n - off} bytes of trailing data")
    return _build(buf, schema, scalars, var)


def type_of(buf: bytes) -> type | None:
    """The message class a buffer claims to be (None when unknown or too short)."""
    if len(buf) < 8:
        return None
    schema = _BY_TYPE.get(_HEAD.unpack_from(buf)[0])
    return schema.cls if schema else None
