"""The gateway's upstream HTTP client against a raw asyncio server on 127.0.0.1: the lazily
re-armed idle timer (a long healthy stream is never cut, a stall is), and chunks that arrive
together are handed over together, in order, with nothing held back."""

from __future__ import annotations

import asyncio

import pytest

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError

_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _serve(handler: object) -> tuple[asyncio.Server, str]:
    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            await handler(writer)  # type: ignore[operator]
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_slow_but_steady_stream_outlives_the_idle_timeout_then_a_stall_times_out() -> None:
    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(_HEAD)
        for i in range(8):  # 8 x 0.1 s: longer than the 0.3 s idle timeout in total
            writer.write(_chunk(b"t%d;" % i))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(5)  # then stall

    async def main() -> tuple[bytes, str, float]:
        server, url = await _serve(handler)
        pool = ClientPool()
        try:
            resp = await pool.request(url, "GET", "/", timeouts=Timeouts(1, 1, idle_s=0.3))
            got = b""
            loop = asyncio.get_running_loop()
            t_last = loop.time()
            with pytest.raises(UpstreamError) as info:
                while (chunk := await resp.next_chunk()) is not None:
                    got += chunk
                    t_last = loop.time()
            stalled_s = loop.time() - t_last
            resp.release()
            return got, info.value.kind, stalled_s
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    got, kind, stalled_s = asyncio.run(main())
    assert got == b"".join(b"t%d;" % i for i in range(8))
    assert kind == "idle"
    assert 0.25 < stalled_s < 3.0


def test_chunks_that_arrived_together_come_out_together_in_order() -> None:
    release = asyncio.Event()

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(_HEAD + _chunk(b"a"))
        await writer.drain()
        await release.wait()
        writer.write(_chunk(b"b") + _chunk(b"c") + _chunk(b"d") + b"0\r\n\r\n")
        await writer.drain()

    async def main() -> list[bytes | None]:
        server, url = await _serve(handler)
        pool = ClientPool()
        try:
            resp = await pool.request(url, "GET", "/")
            out = [await resp.next_chunk()]
            release.set()
            await asyncio.sleep(0.2)  # b, c, d are all received before we ask again
            out += [await resp.next_chunk(), await resp.next_chunk()]
            resp.release()
            return out
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == [b"a", b"bcd", None]


def test_pipe_hands_chunks_over_as_they_arrive_and_times_out_a_stall() -> None:
    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(_HEAD + _chunk(b"t0;"))
        await writer.drain()
        for i in range(1, 6):  # 5 x 0.1 s: longer than the 0.3 s idle timeout in total
            await asyncio.sleep(0.1)
            writer.write(_chunk(b"t%d;" % i))
            await writer.drain()
        await asyncio.sleep(5)  # then stall

    async def main() -> tuple[list[bytes], str]:
        server, url = await _serve(handler)
        pool = ClientPool()
        try:
            resp = await pool.request(url, "GET", "/", timeouts=Timeouts(1, 1, idle_s=0.3))
            got: list[bytes] = []
            ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()
            resp.pipe(got.append, ended.set_result)
            err = await asyncio.wait_for(ended, 3)
            resp.release()
            assert err is not None
            return got, err.kind
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    got, kind = asyncio.run(main())
    assert b"".join(got) == b"".join(b"t%d;" % i for i in range(6))
    assert kind == "idle"


def test_a_tightened_idle_bound_cuts_a_stall_but_not_a_read_we_paused() -> None:
    """`set_idle_timeout` (a started stream's silence bound) takes effect at once; while we
    hold the upstream's reads back (a slow client), its silence is not counted."""
    go_on = asyncio.Event()

    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(_HEAD + _chunk(b"t0;"))
        await writer.drain()
        await go_on.wait()  # silent while the reader is paused
        writer.write(_chunk(b"t1;"))
        await writer.drain()
        await asyncio.sleep(5)  # then stall

    async def main() -> tuple[list[bytes], str, float]:
        server, url = await _serve(handler)
        pool = ClientPool()
        loop = asyncio.get_running_loop()
        try:
            resp = await pool.request(url, "GET", "/", timeouts=Timeouts(1, 1, idle_s=30))
            got: list[bytes] = []
            ended: asyncio.Future[UpstreamError | None] = loop.create_future()
            resp.pipe(got.append, ended.set_result)
            resp.set_idle_timeout(0.2)
            resp.pause_reading()
            await asyncio.sleep(0.6)  # three bounds: paused, so no time-out
            assert not ended.done()
            resp.resume_reading()
            go_on.set()
            t0 = loop.time()
            err = await asyncio.wait_for(ended, 3)
            resp.release()
            assert err is not None
            return got, err.kind, loop.time() - t0
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    got, kind, stalled_s = asyncio.run(main())
    assert b"".join(got) == b"t0;t1;"
    assert kind == "idle"
    assert 0.15 < stalled_s < 1.0  # the tightened bound, not the 30 s one


def test_pipe_ends_cleanly_and_the_connection_is_reused() -> None:
    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(_HEAD + _chunk(b"a"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunk(b"b") + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> tuple[bytes, UpstreamError | None, int]:
        server, url = await _serve(handler)
        pool = ClientPool()
        try:
            resp = await pool.request(url, "GET", "/")
            got: list[bytes] = []
            ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()

            def on_end(err: UpstreamError | None) -> None:
                resp.release()
                ended.set_result(err)

            resp.pipe(got.append, on_end)
            err = await asyncio.wait_for(ended, 3)
            return b"".join(got), err, len(pool._idle.get(url, []))
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    body, err, num_idle = asyncio.run(main())
    assert (body, err, num_idle) == (b"ab", None, 1)


async def _upstream_that_sees_eof(
    head: bytes | None, seen: list[str]
) -> tuple[asyncio.Server, str]:
    """An upstream that reads a request head, sends `head` and one chunk (or nothing), then
    records when the client closes its connection ("eof")."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            if head is not None:
                writer.write(head + _chunk(b"first"))
                await writer.drain()
            while await reader.read(65536):
                pass  # the request's body
            seen.append("eof")
        except ConnectionResetError:
            seen.append("eof")
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_a_caller_cancelled_before_the_head_aborts_the_upstream_request() -> None:
    """The disconnect contract reaches the engine: a gateway handler cancelled while waiting
    for the upstream's head aborts the upstream connection, and the pool keeps nothing."""
    seen: list[str] = []

    async def main() -> int:
        server, url = await _upstream_that_sees_eof(None, seen)
        pool = ClientPool()
        try:
            task = asyncio.create_task(pool.request(url, "POST", "/v1/x", b"{}"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            return sum(len(conns) for conns in pool._idle.values())
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    num_idle = asyncio.run(main())
    assert seen == ["eof"]
    assert num_idle == 0


def test_releasing_an_unfinished_response_closes_the_upstream_connection() -> None:
    seen: list[str] = []

    async def main() -> tuple[bytes, int]:
        server, url = await _upstream_that_sees_eof(_HEAD, seen)
        pool = ClientPool()
        try:
            resp = await pool.request(url, "GET", "/")
            first = await resp.next_chunk()
            assert first is not None
            resp.release()
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            return first, sum(len(conns) for conns in pool._idle.values())
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    first, num_idle = asyncio.run(main())
    assert first == b"first"
    assert seen == ["eof"]
    assert num_idle == 0


def test_an_oversized_upstream_head_is_a_protocol_error() -> None:
    async def handler(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        for _ in range(64):  # 4 MB of one header value, never ended
            writer.write(b"a" * 65536)
            await writer.drain()
        await asyncio.sleep(5)

    async def main() -> tuple[str, float]:
        server, url = await _serve(handler)
        pool = ClientPool(max_head_bytes=16 * 1024)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            with pytest.raises(UpstreamError) as info:
                await pool.request(url, "GET", "/", timeouts=Timeouts(1, 3, 3))
            return info.value.kind, loop.time() - t0
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    kind, took_s = asyncio.run(main())
    assert kind == "protocol"
    assert took_s < 1.0


def test_a_large_body_right_behind_the_head_is_not_mistaken_for_a_large_head() -> None:
    body = b"x" * (1 << 20)

    async def handler(writer: asyncio.StreamWriter) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
        writer.write(head + body)  # one write: the first read holds the head and the body
        await writer.drain()

    async def main() -> bytes:
        server, url = await _serve(handler)
        pool = ClientPool(max_head_bytes=1024)
        try:
            resp = await pool.request(url, "GET", "/")
            try:
                return await resp.read()
            finally:
                resp.release()
        finally:
            await pool.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == body
