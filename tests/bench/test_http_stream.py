"""pagedserve.services.bench.http_stream against a real socket server that answers in awkward pieces."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.bench.http_stream import StreamError, post_sse

EVENTS = [b'{"i":0,"text":"a"}', b'{"i":1,"text":"b\\nc"}', b"[DONE]"]


def _sse_body(crlf: bool = False) -> bytes:
    sep = b"\r\n" if crlf else b"\n"
    return b"".join(b"data: " + e + sep + sep for e in EVENTS)


def _chunked(body: bytes, size: int) -> bytes:
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"


async def _serve_once(answer: bytes, piece: int, close: bool):
    """A server that reads one request, then writes `answer` `piece` bytes at a time."""
    seen: dict[str, bytes] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        seen["head"], seen["body"] = head, await reader.readexactly(length)
        for i in range(0, len(answer), piece):
            writer.write(answer[i:i + piece])
            await writer.drain()
            await asyncio.sleep(0)
        if close:
            writer.close()
        else:
            await asyncio.sleep(5)  # a chunked answer must end by its last chunk, not by the close

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def _run(answer: bytes, piece: int, close: bool = False):
    async def main():
        server, port, seen = await _serve_once(answer, piece, close)
        got: list[bytes] = []
        async with server:
            status, error = await asyncio.wait_for(
                post_sse(f"http://127.0.0.1:{port}/v1/completions", b'{"x":1}', {"Authorization": "Bearer k"},
                         lambda data, t: got.append(data)), 10)
        return status, error, got, seen
    return asyncio.run(main())


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"


@pytest.mark.parametrize("chunk_size,piece", [(1000, 1000), (7, 3), (1, 1), (13, 64)])
def test_chunked_events_arrive_whole_however_the_bytes_are_cut(chunk_size, piece):
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(_sse_body(), chunk_size)
    status, error, got, seen = _run(answer, piece)
    assert (status, error, got) == (200, b"", EVENTS)
    assert seen["body"] == b'{"x":1}'
    assert b"POST /v1/completions HTTP/1.1\r\n" in seen["head"] and b"Authorization: Bearer k\r\n" in seen["head"]


def test_content_length_body_and_crlf_lines():
    body = _sse_body(crlf=True)
    status, _, got, _ = _run(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body, 5)
    assert (status, got) == (200, EVENTS)


def test_body_ended_by_the_close():
    status, _, got, _ = _run(HEAD + b"\r\n" + _sse_body(), 4, close=True)
    assert (status, got) == (200, EVENTS)


def test_error_status_returns_its_body_and_no_events():
    body = b'{"error":{"message":"bad"}}'
    answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    status, error, got, _ = _run(answer, 10)
    assert (status, error, got) == (400, body, [])


def test_a_stream_cut_short_is_an_error():
    answer = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(_sse_body(), 8)[:-20]
    with pytest.raises(StreamError, match="closed before the response ended"):
        _run(answer, 16, close=True)


def test_nothing_listening_is_an_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await post_sse(f"http://127.0.0.1:{port}/", b"{}", {}, lambda d, t: None)
    with pytest.raises(StreamError, match="cannot connect"):
        asyncio.run(main())


def test_only_http_urls():
    with pytest.raises(ValueError, match="http:// URLs only"):
        asyncio.run(post_sse("https://example.com/", b"{}", {}, lambda d, t: None))
