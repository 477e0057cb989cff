"""A frame-level HTTP/2 client (h2c, prior knowledge) that shows what the server sent.

Built on ``hyperframe`` and ``hpack`` rather than ``h2``: ``h2``'s state machine closes
the connection when it *receives* a GOAWAY (python-hyper/h2#1181), so a client built on
it cannot watch streams finish after one.  This client records every frame per stream
— response headers, body, END_STREAM, RST_STREAM — and every GOAWAY with its
last-stream-id, in arrival order, so tests can assert RFC 9113's graceful shutdown:
accepted streams complete, nothing accepted is reset, GOAWAY names the highest stream
accepted.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import ClassVar

from hpack import Decoder, Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass
class Stream:
    """What the server sent on one stream."""

    status: int | None = None
    body: bytes = b""
    ended: bool = False
    reset: int | None = None  # RST_STREAM error code


@dataclass
class Goaway:
    last_stream_id: int
    error_code: int
    after: list[int] = field(default_factory=list)  # streams that had ended before it


class RawH2:
    """One HTTP/2 connection over a blocking socket.  Every instance is closed by
    :meth:`close_all` (the tests' fixture calls it)."""

    opened: ClassVar[list[RawH2]] = []

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.streams: dict[int, Stream] = {}
        self.goaways: list[Goaway] = []
        self.events: list[str] = []  # "end 1", "rst 3", "goaway 3", "eof"
        self.eof = False
        self._next_id = 1
        self._buffer = b""
        self._headers_block: tuple[int, bytes, bool] | None = None
        RawH2.opened.append(self)
        settings = SettingsFrame(0)
        settings.settings = {SettingsFrame.ENABLE_PUSH: 0}
        self.sock.sendall(PREFACE + settings.serialize())

    @classmethod
    def close_all(cls) -> None:
        while cls.opened:
            cls.opened.pop().close()

    def close(self) -> None:
        self.sock.close()

    def request(self, path: str) -> int:
        """Send a GET for ``path`` on a new stream; return its id."""
        return self._open([(":method", "GET"), (":path", path)], end_stream=True)

    def websocket(self, path: str) -> int:
        """Open a websocket on a new stream (RFC 8441's extended CONNECT)."""
        return self._open(
            [(":method", "CONNECT"), (":protocol", "websocket"), (":path", path),
             ("sec-websocket-version", "13")],
            end_stream=False,
        )  # fmt: skip

    def _open(self, headers: list[tuple[str, str]], *, end_stream: bool) -> int:
        stream_id = self._next_id
        self._next_id += 2
        pseudo = [h for h in headers if h[0].startswith(":")]
        regular = [h for h in headers if not h[0].startswith(":")]
        block = self.encoder.encode(
            [*pseudo, (":scheme", "http"), (":authority", "test"), *regular]
        )
        flags = ["END_HEADERS", "END_STREAM"] if end_stream else ["END_HEADERS"]
        self.streams[stream_id] = Stream()
        self.sock.sendall(HeadersFrame(stream_id, block, flags=flags).serialize())
        return stream_id

    def send_data(self, stream_id: int, data: bytes) -> None:
        self.sock.sendall(DataFrame(stream_id, data).serialize())

    def wait_body(self, stream_id: int, size: int, timeout_s: float = 10.0) -> bytes:
        """Read until ``stream_id``'s body holds at least ``size`` bytes."""
        deadline = time.monotonic() + timeout_s
        stream = self.streams[stream_id]
        while len(stream.body) < size:
            left = deadline - time.monotonic()
            if left <= 0 or self.eof:
                raise AssertionError(f"no {size} bytes on stream {stream_id}: {self}")
            self._read(left)
        return stream.body

    # -------------------------------------------------------------- reading

    def wait(self, condition: str, stream_id: int = 0, timeout_s: float = 10.0) -> None:
        """Read frames until ``condition`` holds: ``"headers"`` / ``"end"`` / ``"reset"``
        (of ``stream_id``), ``"goaway"``, or ``"eof"``."""
        deadline = time.monotonic() + timeout_s
        while not self._holds(condition, stream_id):
            if self.eof:
                raise AssertionError(f"connection closed before {condition} {stream_id}: {self}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {condition} {stream_id} within {timeout_s} s: {self}")
            self._read(left)

    def _holds(self, condition: str, stream_id: int) -> bool:
        if condition == "goaway":
            return bool(self.goaways)
        if condition == "eof":
            return self.eof
        stream = self.streams[stream_id]
        if condition == "end":
            return stream.ended
        if condition == "reset":
            return stream.reset is not None
        if condition == "headers":
            return stream.status is not None
        raise ValueError(condition)

    def response(self, stream_id: int, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
        self.wait("end", stream_id, timeout_s)
        stream = self.streams[stream_id]
        return stream.status, stream.body

    def _read(self, timeout_s: float) -> None:
        self.sock.settimeout(timeout_s)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
            self.events.append("eof")
            return
        self._buffer += chunk
        while len(self._buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self._buffer[:9]))
            if len(self._buffer) < 9 + length:
                break
            frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
            self._buffer = self._buffer[9 + length :]
            self._handle(frame)

    def _handle(self, frame: Frame) -> None:
        if isinstance(frame, SettingsFrame):
            if "ACK" not in frame.flags:
                self._control(SettingsFrame(0, flags=["ACK"]))
        elif isinstance(frame, PingFrame):
            if "ACK" not in frame.flags:
                self._control(PingFrame(0, frame.opaque_data, flags=["ACK"]))
        elif isinstance(frame, HeadersFrame):
            self._headers_block = (frame.stream_id, frame.data, "END_STREAM" in frame.flags)
            if "END_HEADERS" in frame.flags:
                self._headers_done()
        elif isinstance(frame, ContinuationFrame):
            assert self._headers_block is not None
            sid, data, end = self._headers_block
            self._headers_block = (sid, data + frame.data, end)
            if "END_HEADERS" in frame.flags:
                self._headers_done()
        elif isinstance(frame, DataFrame):
            stream = self.streams.setdefault(frame.stream_id, Stream())
            stream.body += frame.data
            if frame.flow_controlled_length:
                for sid in (0, frame.stream_id):
                    self._control(WindowUpdateFrame(sid, frame.flow_controlled_length))
            if "END_STREAM" in frame.flags:
                self._end(frame.stream_id)
        elif isinstance(frame, RstStreamFrame):
            self.streams.setdefault(frame.stream_id, Stream()).reset = frame.error_code
            self.events.append(f"rst {frame.stream_id}")
        elif isinstance(frame, GoAwayFrame):
            ended = [sid for sid, s in self.streams.items() if s.ended]
            self.goaways.append(Goaway(frame.last_stream_id, frame.error_code, ended))
            self.events.append(f"goaway {frame.last_stream_id}")

    def _control(self, frame: Frame) -> None:
        """Answer the server (ACKs, flow control); it may have closed already."""
        with contextlib.suppress(OSError):
            self.sock.sendall(frame.serialize())

    def _headers_done(self) -> None:
        assert self._headers_block is not None
        sid, data, end = self._headers_block
        self._headers_block = None
        headers = dict(self.decoder.decode(data))
        stream = self.streams.setdefault(sid, Stream())
        if stream.status is None:
            stream.status = int(headers[":status"])
        if end:
            self._end(sid)

    def _end(self, stream_id: int) -> None:
        self.streams[stream_id].ended = True
        self.events.append(f"end {stream_id}")

    def __repr__(self) -> str:
        return f"<RawH2 events={self.events} streams={self.streams}>"
