from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastkv.cache.plan import CopyKind
from fastkv.ipc import BadMessage, DoneMsg, OutputMsg, PlanMsg, TaskMsg, decode, encode, message

i32s = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(lambda v: np.array(v, np.int32))
texts = st.text(max_size=20)


def same(a, b) -> None:
    assert type(a) is type(b)
    for name in a.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            assert len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y, strict=True)), name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and y.dtype == x.dtype, name
        else:
            assert list(x) == list(y) if isinstance(x, tuple | list) else x == y, name


@given(st.integers(-(2**63), 2**63 - 1), st.sampled_from(list(CopyKind)), i32s, i32s,
       st.lists(st.binary(max_size=40), max_size=10), st.integers(0, 2**62))
def test_task_roundtrip(task_id, kind, src, dst, keys, layered):
    msg = TaskMsg(task_id, kind, src, dst, tuple(keys), layered)
    buf = encode(msg)
    assert len(buf) % 8 == 0
    same(msg, decode(buf))


@given(st.integers(0, 2**62), st.integers(0, 64), st.booleans(), st.integers(0, 2**62), st.floats(allow_nan=False),
       texts)
def test_done_roundtrip(task_id, rank, ok, nbytes, seconds, error):
    msg = DoneMsg(task_id, rank, ok, nbytes, seconds, error)
    assert decode(encode(msg)) == msg


@given(st.lists(st.tuples(texts, i32s, i32s, st.integers(0, 10_000)), max_size=8), st.integers(0, 2**40),
       st.lists(st.integers(0, 2**62), max_size=4))
def test_plan_and_output_roundtrip(reqs, step, landing):
    plan = PlanMsg(step, [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs],
                   np.array([r[3] for r in reqs], np.int32), wait_landed=np.array(landing, np.int64))
    same(plan, decode(encode(plan)))
    out = OutputMsg(step, 5, 0.25, [r[0] for r in reqs], np.arange(len(reqs), dtype=np.int32), "")
    same(out, decode(encode(out)))


def test_decoded_arrays_are_read_only_views():
    msg = decode(encode(TaskMsg(1, 1, np.array([1, 2], np.int32), np.array([3, 4], np.int32))))
    with pytest.raises(ValueError):
        msg.src[0] = 9


def test_encode_rejects_bad_fields():
    with pytest.raises(TypeError, match="not a registered"):
        encode(("task", 1))
    with pytest.raises(ValueError, match="outside int32"):
        encode(TaskMsg(1, 1, np.array([2**40]), np.array([1])))
    with pytest.raises(TypeError, match="integers"):
        encode(TaskMsg(1, 1, np.array([1.5]), np.array([1])))
    with pytest.raises(TypeError, match="TaskMsg.keys must hold bytes"):
        encode(TaskMsg(1, 1, keys=("text",)))
    with pytest.raises(TypeError, match="DoneMsg.error must be str"):
        encode(DoneMsg(1, 0, False, error=b"x"))
    with pytest.raises(ValueError, match="bad scalar"):
        encode(DoneMsg(1, 2**40, True))
    with pytest.raises(ValueError, match="per-request lists differ"):
        PlanMsg(1, ["a"], [], [], np.array([], np.int32))


def test_decode_rejects_malformed_bytes():
    buf = encode(TaskMsg(5, 2, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), (b"k1", b"k2")))
    for cut in (0, 3, 8, 20, len(buf) - 8, len(buf) - 1):
        with pytest.raises(BadMessage):
            decode(buf[:cut])
    with pytest.raises(BadMessage, match="trailing|header says"):
        decode(buf + b"\0" * 8)
    with pytest.raises(BadMessage, match="unknown message type"):
        decode(struct.pack("<HHI", 999, 0, 8))
    wrong_tag = bytearray(buf)
    wrong_tag[2] ^= 0xFF
    with pytest.raises(BadMessage, match="schema tag"):
        decode(bytes(wrong_tag))
    # a count that disagrees with the byte size of the src array
    off = 8 + 24  # the header, then the scalars: task_id, kind (padded), layered
    corrupt = bytearray(buf)
    struct.pack_into("<I", corrupt, off, 5)
    with pytest.raises(BadMessage, match="TaskMsg.src"):
        decode(bytes(corrupt))
    with pytest.raises(BadMessage, match="UTF-8"):
        done = bytearray(encode(DoneMsg(1, 0, False, error="ab")))
        at = done.index(b"ab")  # the error text's bytes (not the last field since DoneMsg.found)
        done[at:at + 2] = b"\xff\xfe"
        decode(bytes(done))


def test_new_message_types_register_and_collide():
    @message(900)
    @dataclass(slots=True)
    class PingMsg:
        WIRE: ClassVar[str] = "seq:i64 ids:i64[] note:str"
        seq: int
        ids: np.ndarray
        note: str = ""

    got = decode(encode(PingMsg(3, np.array([2**40], np.int64), "hi")))
    assert got.seq == 3 and got.ids.tolist() == [2**40] and got.note == "hi"
    with pytest.raises(ValueError, match="already taken"):
        message(900)(PingMsg)


messages = st.one_of(
    st.builds(lambda t, k, s, d, keys: TaskMsg(t, k, s, d, tuple(keys)), st.integers(0, 2**40),
              st.sampled_from(list(CopyKind)), i32s, i32s, st.lists(st.binary(max_size=12), max_size=5)),
    st.builds(lambda t, s, d: TaskMsg(t, 1, s.tolist(), list(d)), st.integers(0, 9), i32s, i32s),  # slow path
    st.builds(DoneMsg, st.integers(0, 2**40), st.integers(0, 7), st.booleans(), st.integers(0, 2**40),
              st.floats(allow_nan=False), texts),
    st.builds(lambda r, t, b: PlanMsg(1, r, [t] * len(r), [b] * len(r), np.arange(len(r), dtype=np.int32)),
              st.lists(texts, max_size=4), i32s, i32s),
)


@given(messages, st.data())
def test_c_fast_path_matches_python_reference(msg, data):
    from fastkv.ipc.codec import decode_py, encode_py

    buf = encode(msg)
    assert buf == encode_py(msg)
    same_or_equal(decode(buf), decode_py(buf))
    # corrupt one byte or cut the message: both decoders agree (same message or both BadMessage)
    i = data.draw(st.integers(0, len(buf) - 1))
    bad = bytearray(buf)
    bad[i] ^= data.draw(st.integers(1, 255))
    for variant in (bytes(bad), buf[:i]):
        outcomes = []
        for dec in (decode, decode_py):
            try:
                outcomes.append(dec(variant))
            except BadMessage:
                outcomes.append(None)
        assert (outcomes[0] is None) == (outcomes[1] is None), f"decoders disagree on byte {i}"
        if outcomes[0] is not None:
            same_or_equal(*outcomes)


def same_or_equal(a, b) -> None:
    if isinstance(a, DoneMsg):
        assert a == b or (a.seconds != a.seconds and b.seconds != b.seconds)
    else:
        same(a, b)


@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_batch_codec_matches_per_message_reference(msgs, data):
    from fastkv.ipc.codec import bad_message, decode_many, decode_py, encode_many, encode_py

    bufs = encode_many(msgs)
    assert bufs == [encode_py(m) for m in msgs]
    got, bad, why = decode_many(bufs)
    assert bad == -1 and why is None and len(got) == len(msgs)
    for a, b in zip(got, msgs, strict=True):
        same_or_equal(a, decode_py(encode_py(b)))
    # corrupt one buffer: the batch stops there, naming what the reference names, or goes through
    k = data.draw(st.integers(0, len(bufs) - 1))
    i = data.draw(st.integers(0, len(bufs[k]) - 1))
    corrupt = bytearray(bufs[k])
    corrupt[i] ^= data.draw(st.integers(1, 255))
    bufs[k] = bytes(corrupt)
    got, bad, why = decode_many(bufs)
    try:
        decode_py(bufs[k])
    except BadMessage as exc:
        assert (bad, len(got)) == (k, k)
        ours, ref = str(bad_message(bufs[k], why)), str(exc)
        assert ours.split(":")[:2] == ref.split(":")[:2], (ours, ref)  # "bad message (n bytes): Class.field"
    else:
        assert bad == -1 and len(got) == len(bufs)


def test_batch_accept_stops_at_another_type():
    from fastkv.ipc.codec import decode_many, encode_many

    with pytest.raises(TypeError, match="not a registered"):
        encode_many([DoneMsg(1, 0, True), "text"])
    bufs = encode_many([DoneMsg(1, 0, True), TaskMsg(2, 1), DoneMsg(3, 0, True)], accept=(DoneMsg, TaskMsg))
    got, bad, why = decode_many(bufs, (DoneMsg,))
    assert got == [DoneMsg(1, 0, True)] and (bad, why) == (1, None)
    assert decode_many(bufs[2:] + [b"x"], (DoneMsg,))[1:] == (1, "shorter than the 8-byte header")


def test_values_needing_conversion_take_the_python_path():
    from fastkv.ipc.codec import decode_py, encode_py

    msgs = [TaskMsg(np.int64(7), CopyKind.STORE, [1, 2], np.array([3, 4], np.uint8)),
            DoneMsg(1, 0, np.bool_(True), 5, 2, ""),  # numpy bool, int seconds
            TaskMsg(1, 1, np.arange(6, dtype=np.int32)[::2], np.arange(3, dtype=np.int64))]
    for msg in msgs:
        assert encode(msg) == encode_py(msg)
        same_or_equal(decode(encode(msg)), decode_py(encode_py(msg)))


def test_decoded_arrays_own_their_buffer_and_stay_read_only():
    import gc

    buf = encode(TaskMsg(1, 1, np.array([5, 6, 7], np.int32), np.array([8, 9, 10], np.int32)))
    msg = decode(bytearray(buf))
    del buf
    gc.collect()
    assert msg.src.tolist() == [5, 6, 7] and msg.dst.tolist() == [8, 9, 10] and msg.src.dtype == np.int32
    with pytest.raises(ValueError):
        msg.dst.setflags(write=True)
    assert msg.src.flags.aligned and msg.src.flags.c_contiguous


@message(901)
@dataclass
class _PlainMsg:
    """No slots, scalars after a variable field: the getattr/constructor paths."""

    WIRE: ClassVar[str] = "flag:bool ids:i64[] ratio:f64 name:str small:i32 big:i64"
    flag: bool
    ids: np.ndarray
    ratio: float
    name: str
    small: int
    big: int


@given(st.booleans(), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5), st.floats(allow_nan=False), texts,
       st.integers(-(2**31), 2**31 - 1), st.integers(-(2**63), 2**63 - 1))
def test_plain_dataclass_with_every_scalar_kind(flag, ids, ratio, name, small, big):
    from fastkv.ipc.codec import decode_py, encode_py

    msg = _PlainMsg(flag, np.array(ids, np.int64), ratio, name, small, big)
    buf = encode(msg)
    assert buf == encode_py(msg)
    for got in (decode(buf), decode_py(buf)):
        assert (got.flag, got.ratio, got.name, got.small, got.big) == (flag, ratio, name, small, big)
        assert got.ids.dtype == np.int64 and got.ids.tolist() == ids


def test_class_validation_on_decode_is_a_bad_message():
    from fastkv.ipc.codec import decode_py

    plan = PlanMsg(1, ["a"], [np.array([1], np.int32)], [np.array([2], np.int32)], np.array([0], np.int32))
    plan.num_computed = np.array([0, 0], np.int32)  # inconsistent after construction
    buf = encode(plan)
    for dec in (decode, decode_py):
        with pytest.raises(BadMessage, match="per-request lists differ"):
            dec(buf)


def test_done_carries_lookup_counts():
    msg = DoneMsg(7, 1, True, found=np.array([3, 0, 2], np.int32).tobytes())
    back = decode(encode(msg))
    assert back == msg and back.found_counts.tolist() == [3, 0, 2]


def test_an_empty_string_list_with_bytes_is_bad_in_both_decoders():
    """A PlanMsg whose empty ``release`` claims a byte: the reference decoder blames that field,
    as the C one does (it once went on and blamed the field after it)."""
    from fastkv.ipc.codec import bad_message, decode_many, decode_py, encode_py

    msg = PlanMsg(1, [""], [np.array([0], np.int32)], [np.array([0], np.int32)], np.arange(1, dtype=np.int32))
    buf = bytearray(encode_py(msg))
    buf[108] ^= 1  # release's byte count: 0 -> 1
    _, bad, why = decode_many([bytes(buf)])
    with pytest.raises(BadMessage, match="PlanMsg.release: item lengths do not add up") as ref:
        decode_py(bytes(buf))
    assert bad == 0 and str(bad_message(bytes(buf), why)).split(":")[:2] == str(ref.value).split(":")[:2]
