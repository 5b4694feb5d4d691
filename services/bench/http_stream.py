"""One streaming HTTP/1.1 POST read as server-sent events with minimal client CPU (the client shares
the CPU with the server it measures); each `data:` line goes to on_data(payload, arrival time)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit


class StreamError(Exception):
    """The connection failed or the response was not HTTP/1.x as expected."""


class _SSEProtocol(asyncio.Protocol):
    def __init__(self, on_data: Callable[[bytes, float], None], done: asyncio.Future):
        self.on_data, self.done = on_data, done
        self.raw = bytearray()  # received, not yet de-chunked (or the head, until parsed)
        self.body = bytearray()  # de-chunked, not yet split into lines
        self.status: int | None = None
        self.chunked = False
        self.length: int | None = None  # Content-Length left to read, when the server sent one
        self.error_body = bytearray()  # a non-200 answer's body, for the error message

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.raw += data
        try:
            if self.status is None and not self._parse_head():
                return
            if self.chunked:
                finished = self._dechunk()
            else:
                self.body += self.raw
                if self.length is not None:
                    self.length -= len(self.raw)
                self.raw.clear()
                finished = self.length is not None and self.length <= 0
            self._lines(now)
        except (ValueError, IndexError) as e:
            self._fail(StreamError(f"malformed response: {e}"))
            return
        if finished:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self.status is not None and not self.chunked and self.length is None:
            self._lines(time.perf_counter())  # a body delimited by the close: complete
            self._finish()
        else:
            self._fail(StreamError(f"connection closed before the response ended ({exc or 'eof'})"))

    def _parse_head(self) -> bool:
        end = self.raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.raw[:end]).decode("latin-1").split("\r\n")
        del self.raw[:end + 4]
        self.status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self.chunked and "content-length" in headers:
            self.length = int(headers["content-length"])
        return True

    def _dechunk(self) -> bool:
        """Move whole chunks from raw to body; True once the last (empty) chunk is read."""
        while True:
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                return False
            size = int(bytes(self.raw[:eol]).split(b";")[0], 16)
            if size == 0:
                return True  # trailers, if any, are not needed
            if len(self.raw) < eol + 2 + size + 2:
                return False
            self.body += self.raw[eol + 2:eol + 2 + size]
            del self.raw[:eol + 2 + size + 2]

    def _lines(self, now: float) -> None:
        if self.status != 200:
            self.error_body += self.body
            self.body.clear()
            return
        start = 0
        while (eol := self.body.find(b"\n", start)) >= 0:
            line = bytes(self.body[start:eol]).rstrip(b"\r")
            start = eol + 1
            if line.startswith(b"data:"):
                self.on_data(line[5:].strip(), now)
        del self.body[:start]

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        self.transport.close()

    def _fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        self.transport.close()

    def connection_made(self, transport) -> None:
        self.transport = transport


async def post_sse(url: str, body: bytes, headers: dict[str, str],
                   on_data: Callable[[bytes, float], None]) -> tuple[int, bytes]:
    """POST JSON to an http:// url, streaming `data:` lines to on_data -> (status, non-200 body)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"post_sse reads http:// URLs only, not {url!r}")
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"POST {path} HTTP/1.1", f"Host: {parts.hostname}:{port}", "Content-Type: application/json",
             "Accept: text/event-stream", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    try:
        transport, protocol = await loop.create_connection(lambda: _SSEProtocol(on_data, done),
                                                           parts.hostname, port)
    except OSError as e:
        raise StreamError(f"cannot connect to {parts.hostname}:{port}: {e}") from e
    try:
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await done
    finally:
        transport.close()
    return protocol.status, bytes(protocol.error_body)
