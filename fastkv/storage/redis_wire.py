"""Pipelined SET and GET of block-sized values straight over a redis-py connection.

redis-py's pure-Python reply parser copies every bulk reply 3-4 times (recv, BytesIO
write, read, slice) and its command packer needs a value contiguous, so a block-sized value
loads at a fraction of what the socket carries. This module speaks just the RESP needed for the two hot
commands on a connection borrowed from the pool (redis-py still connects, authenticates,
selects the db and sets the socket timeouts; the pool must speak RESP2):

* ``set_many``: ``SET key value [EX ttl]`` per block; the value goes out as header bytes and
  then the host block's memoryview, so the payload is never copied in user space.
* ``get_many``: ``GET key`` per block; each reply is received straight into one reusable
  buffer (``recv_into``) and handed to a callback that verifies it and copies it into the
  host block before the next reply overwrites the buffer.

Any socket or protocol error disconnects the connection before it returns to the pool, so
a half-read pipeline never leaks into the next command. Uses redis-py's ``Connection._sock``
(the connected socket; present under that name throughout redis-py 3-8).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import redis

_CRLF = b"\r\n"


def _bulk_prefix(arg_len: int) -> bytes:
    return b"$%d\r\n" % arg_len


class _Replies:
    """Reads RESP replies from a socket; small lines through a buffer, big values in place."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.pending = bytearray()
        self.pos = 0

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        if self.pos:
            del self.pending[: self.pos]
            self.pos = 0
        self.pending += chunk

    def line(self) -> bytes:
        while (end := self.pending.find(_CRLF, self.pos)) < 0:
            self._fill()
        line = bytes(self.pending[self.pos:end])
        self.pos = end + 2
        return line

    def into(self, dest: memoryview) -> None:
        """Exactly ``len(dest)`` bytes, then the CRLF that ends a bulk string."""
        take = min(len(dest), len(self.pending) - self.pos)
        dest[:take] = self.pending[self.pos:self.pos + take]
        self.pos += take
        got = take
        while got < len(dest):
            n = self.sock.recv_into(dest[got:])
            if n == 0:
                raise redis.ConnectionError("Redis closed the connection mid-value")
            got += n
        while len(self.pending) - self.pos < 2:
            self._fill()
        if self.pending[self.pos:self.pos + 2] != _CRLF:
            raise redis.ConnectionError("RESP bulk string not followed by CRLF")
        self.pos += 2

    def done(self) -> None:
        if self.pos != len(self.pending):
            raise redis.ConnectionError("unexpected bytes after the last reply")


class Wire:
    """Hot-path SET/GET pipelines over connections of ``pool``."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self._buffer = bytearray()

    def _run(self, body):
        conn = self.pool.get_connection()
        try:
            return body(conn._sock)
        except BaseException:
            conn.disconnect()  # the pipeline may be half sent or half read
            raise
        finally:
            self.pool.release(conn)

    def set_many(self, items: Sequence[tuple[bytes, bytes, memoryview]], ttl: int | None) -> list[bool | str]:
        """``SET key header+payload [EX ttl]`` for each item; True, or the server's error text."""
        tail = [b"$2\r\nEX\r\n", _bulk_prefix(len(str(ttl))), str(ttl).encode(), _CRLF] if ttl else []
        nargs = b"*5\r\n" if ttl else b"*3\r\n"

        def body(sock):
            carry = b""
            for key, header, payload in items:
                head = b"".join((carry, nargs, b"$3\r\nSET\r\n", _bulk_prefix(len(key)), key, _CRLF,
                                 _bulk_prefix(len(header) + len(payload)), header))
                sock.sendall(head)
                sock.sendall(payload)
                carry = b"".join([_CRLF, *tail])
            sock.sendall(carry)
            replies = _Replies(sock)
            out: list[bool | str] = []
            for _ in items:
                line = replies.line()
                if line == b"+OK":
                    out.append(True)
                elif line.startswith(b"-"):
                    out.append(line[1:].decode(errors="replace"))
                else:
                    raise redis.ConnectionError(f"unexpected reply to SET: {line[:40]!r}")
            replies.done()
            return out

        return self._run(body)

    def get_many(self, keys: Sequence[bytes], value_bytes: int, consume: Callable[[int, memoryview | str], None]):
        """``GET`` each key; calls ``consume(i, value)`` for each present value (a view valid
        only during the call; a value of unexpected size is passed too, so it can be flagged),
        or ``consume(i, error_text)`` for an error reply. Absent keys are skipped."""
        if len(self._buffer) < value_bytes:
            self._buffer = bytearray(value_bytes)
        buffer = memoryview(self._buffer)

        def body(sock):
            sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n%s%s\r\n" % (_bulk_prefix(len(k)), k) for k in keys))
            replies = _Replies(sock)
            for i in range(len(keys)):
                line = replies.line()
                if line == b"_":  # RESP3 null, should a server answer in RESP3 anyway
                    continue
                if line.startswith(b"$"):
                    size = int(line[1:])
                    if size < 0:
                        continue
                    dest = buffer[:size] if size <= len(buffer) else memoryview(bytearray(size))
                    replies.into(dest)
                    consume(i, dest)
                elif line.startswith(b"-"):
                    consume(i, line[1:].decode(errors="replace"))
                else:
                    raise redis.ConnectionError(f"unexpected reply to GET: {line[:40]!r}")
            replies.done()

        self._run(body)
