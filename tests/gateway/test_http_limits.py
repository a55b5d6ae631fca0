"""flexpipe.http.server under hostile and careless clients: head, URL and body limits, the read,
keep-alive and write timeouts, the connection cap, pipelined floods, HTTP/1.0 streams, HEAD,
and the disconnect contract. The server runs on its own event loop in a thread; clients are
blocking sockets on 127.0.0.1 with timeouts, so a server bug fails a test, never hangs it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
import uvloop

from flexpipe.http.server import (
    App,
    ChunkWriter,
    HttpLimits,
    HttpServer,
    PushResponse,
    Request,
    Response,
    StreamResponse,
    json_response,
    serve,
)

TIMEOUT_S = 5.0
LIMITS = HttpLimits(
    max_header_bytes=16 * 1024,
    max_header_count=50,
    max_url_bytes=1024,
    max_body_bytes=64 * 1024,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    keep_alive_timeout_s=0.4,
    write_timeout_s=0.4,
    max_connections=8,
    max_pipelined_requests=8,
    refusal_linger_s=0.5,
)


class Events:
    """What handlers saw, written on the server's thread and read by the test's."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.release = threading.Event()  # lets /wait handlers finish

    def add(self, what: str) -> None:
        self.log.append(what)

    def wait_for(self, what: str, timeout_s: float = TIMEOUT_S) -> float:
        """Seconds until `what` was logged (fails after `timeout_s`)."""
        t0 = time.monotonic()
        while what not in self.log:
            assert time.monotonic() - t0 < timeout_s, f"{what!r} not seen; log: {self.log}"
            time.sleep(0.01)
        return time.monotonic() - t0


def make_app(ev: Events) -> App:
    app = App(limits=LIMITS)

    @app.route("GET", "/a")
    async def a(req: Request) -> Response:
        return json_response({"path": req.path, "query": req.query})

    @app.route("POST", "/small", max_body_bytes=1000)
    async def small(req: Request) -> Response:
        return json_response({"n": len(req.body)})

    @app.route("POST", "/big")
    async def big(req: Request) -> Response:
        return json_response({"n": len(req.body)})

    @app.route("GET", "/sleep")
    async def sleep(req: Request) -> Response:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            ev.add("cancelled " + req.query)
            raise
        finally:
            ev.add("finally " + req.query)
        return Response(b"")

    @app.route("GET", "/wait")
    async def wait(req: Request) -> Response:
        while not ev.release.is_set():
            await asyncio.sleep(0.01)
        return Response(b"done")

    @app.route("GET", "/stream")
    async def stream(req: Request) -> StreamResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(3):
                    yield b"data: %d\n\n" % i
            finally:
                ev.add("stream closed")

        return StreamResponse(gen())

    @app.route("GET", "/firehose")
    async def firehose(req: Request) -> StreamResponse:
        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"x" * (1 << 20)
            finally:
                ev.add("firehose closed")

        return StreamResponse(gen())

    @app.route("GET", "/push")
    async def push(req: Request) -> PushResponse:
        def start(writer: ChunkWriter) -> None:
            writer.on_close = lambda: ev.add("push closed")
            if not writer.closed:
                writer.write(b"data: a\n\n")
                writer.end(b"data: [DONE]\n\n")

        return PushResponse(start)

    return app


class Server:
    """An HttpServer on its own loop in a thread."""

    def __init__(self, app: App, loop_kind: str) -> None:
        self.loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
        self.server: HttpServer | None = None
        self.port = 0
        started = threading.Event()

        async def main() -> None:
            self.server = await serve(app, "127.0.0.1", 0)
            started.set()

        self.thread = threading.Thread(target=self._run, args=(main,), daemon=True)
        self.thread.start()
        assert started.wait(TIMEOUT_S)
        assert self.server is not None
        self.port = self.server.port

    def _run(self, main: Any) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(main())
        self.loop.run_forever()

    def stop(self) -> None:
        assert self.server is not None
        fut = asyncio.run_coroutine_threadsafe(self.server.close(), self.loop)
        fut.result(TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.loop.close()

    def call(self, fn: Any) -> Any:
        """Run `fn()` on the server's loop and return its result."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(TIMEOUT_S)


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture(params=["uvloop", "asyncio"])
def server(events: Events, request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = Server(make_app(events), request.param)
    try:
        yield srv
    finally:
        events.release.set()
        srv.stop()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
    sock.settimeout(TIMEOUT_S)
    return sock


def read_response(
    sock: socket.socket, buf: bytearray | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One response from `sock` (Content-Length, chunked, or until close); `buf` keeps bytes
    that belong to the next pipelined response."""
    buf = bytearray() if buf is None else buf

    def fill() -> bool:
        data = sock.recv(65536)
        buf.extend(data)
        return bool(data)

    while b"\r\n\r\n" not in buf:
        assert fill(), f"closed before a response head: {bytes(buf)!r}"
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    del buf[: len(head) + 4]
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    del rest
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(buf) < n:
            assert fill()
        body = bytes(buf[:n])
        del buf[:n]
        return status, headers, body
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in buf:
                assert fill()
            size_line, _, _ = bytes(buf).partition(b"\r\n")
            size = int(size_line, 16)
            while len(buf) < len(size_line) + 2 + size + 2:
                assert fill()
            body += bytes(buf[len(size_line) + 2 : len(size_line) + 2 + size])
            del buf[: len(size_line) + 2 + size + 2]
            if size == 0:
                return status, headers, body
    while fill():
        pass
    body = bytes(buf)
    buf.clear()
    return status, headers, body


def error_of(body: bytes) -> dict[str, Any]:
    """The OpenAI error object of an error body (fails if the shape is not OpenAI's)."""
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return dict(err)


def closed_by_server(sock: socket.socket, timeout_s: float = TIMEOUT_S) -> float:
    """Seconds until the server closes `sock` (reading and dropping what comes)."""
    t0 = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def get_ok(port: int) -> float:
    """Seconds for a GET /a on a new connection (asserting it is answered)."""
    t0 = time.monotonic()
    with connect(port) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
        status, _, _ = read_response(sock)
        assert status == 200
    return time.monotonic() - t0


def send_until_answered(
    sock: socket.socket, head: bytes, filler: bytes, total_bytes: int
) -> tuple[bytes, int]:
    """Send `head` and then `filler` up to `total_bytes`, stopping as soon as the server
    answers (or drops the connection); returns what it answered and the bytes sent."""
    sock.setblocking(False)
    out = memoryview(head + filler * (total_bytes // len(filler)))
    sent = 0
    answer = b""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        readable, writable, _ = select.select([sock], [sock] if sent < len(out) else [], [], 0.5)
        if readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
            if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                break
        if writable:
            try:
                sent += sock.send(out[sent : sent + (1 << 20)])
            except (BrokenPipeError, ConnectionResetError):
                break
    sock.settimeout(TIMEOUT_S)
    return answer, sent


# --- head limits -----------------------------------------------------------------------------
def test_a_64mb_header_is_refused_at_once_and_others_are_still_served(server: Server) -> None:
    with connect(server.port) as sock:
        t0 = time.monotonic()
        answer, sent = send_until_answered(
            sock, b"GET /a HTTP/1.1\r\nhost: t\r\nx-big: ", b"a" * 65536, 64 << 20
        )
        refused_s = time.monotonic() - t0
        status, _, body = read_response(sock, bytearray(answer))
        assert status == 431
        assert "header fields too large" in error_of(body)["message"]
        assert refused_s < 1.0
        assert sent < 32 << 20  # refused long before the 64 MB went out
        # meanwhile another connection is served at once
        assert get_ok(server.port) < 0.5
        assert closed_by_server(sock) < 2.0


def test_100000_headers_are_refused_at_once(server: Server) -> None:
    with connect(server.port) as sock:
        t0 = time.monotonic()
        answer, _ = send_until_answered(
            sock, b"GET /a HTTP/1.1\r\nhost: t\r\n", b"x-h: v\r\n", 100_000 * 8
        )
        status, headers, body = read_response(sock, bytearray(answer))
        assert time.monotonic() - t0 < 1.0
        assert status == 431 and headers["connection"] == "close"
        assert error_of(body)["message"] == "Too many request header fields: the limit is 50"
        assert get_ok(server.port) < 0.5


@pytest.mark.parametrize(("num_headers", "status"), [(50, 200), (51, 431)])
def test_the_header_count_limit_is_exact(server: Server, num_headers: int, status: int) -> None:
    """`max_header_count` (50 here) header fields are served, one more is refused: the
    limit counts every field, Host included, and is not off by one either way."""
    head = b"GET /a HTTP/1.1\r\nhost: x\r\n" + b"".join(
        b"x-h%d: v\r\n" % i for i in range(num_headers - 1)
    )
    with connect(server.port) as sock:
        sock.sendall(head + b"\r\n")
        got, _, body = read_response(sock)
    assert got == status
    if status == 431:
        assert error_of(body)["message"] == "Too many request header fields: the limit is 50"


def test_an_http11_request_without_host_gets_400_and_http10_is_served(server: Server) -> None:
    with connect(server.port) as sock:  # RFC 9112 section 3.2
        sock.sendall(b"GET /a HTTP/1.1\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 400 and headers["connection"] == "close"
        assert error_of(body) == {
            "message": "Bad request: an HTTP/1.1 request must carry a Host header",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    with connect(server.port) as sock:  # an HTTP/1.0 client may leave Host out
        sock.sendall(b"GET /a HTTP/1.0\r\n\r\n")
        assert read_response(sock)[:1] == (200,)


def test_a_long_url_gets_414(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /a?" + b"q" * 2000 + b" HTTP/1.1\r\nhost: t\r\n\r\n")
        status, _, body = read_response(sock)
        assert status == 414
        assert error_of(body)["code"] == 414


# --- body limits -----------------------------------------------------------------------------
def test_a_body_over_the_route_limit_gets_413_before_it_is_sent(server: Server) -> None:
    with connect(server.port) as sock:
        # the head alone: the 413 comes without a byte of the body
        sock.sendall(b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 413 and headers["connection"] == "close"
        assert error_of(body)["message"] == "Request body too large: the limit is 1000 bytes"
        # a client that keeps the refused connection open is dropped after refusal_linger_s
        t0 = time.monotonic()
        while server.call(lambda: server.server.num_connections):  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 2.0, "a refused connection lingers on"
            time.sleep(0.02)
        assert time.monotonic() - t0 > 0.3
    with connect(server.port) as sock:  # a chunked body: 413 once the bytes pass the limit
        sock.sendall(b"POST /small HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        sock.sendall(b"400\r\n" + b"x" * 1024 + b"\r\n")
        status, _, _ = read_response(sock)
        assert status == 413
    with connect(server.port) as sock:  # Expect: 100-continue gets 413 or 100 at once
        sock.sendall(
            b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n"
            b"expect: 100-continue\r\n\r\n"
        )
        assert read_response(sock)[0] == 413
    with connect(server.port) as sock:
        sock.sendall(
            b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"abc")
        assert read_response(sock)[2] == b'{"n":3}'
    with connect(server.port) as sock:  # under the limit, and another route's larger limit
        sock.sendall(
            b"POST /small HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000
        )
        assert read_response(sock)[2] == b'{"n":1000}'
        sock.sendall(
            b"POST /big HTTP/1.1\r\nhost: t\r\ncontent-length: 50000\r\n\r\n" + b"x" * 50000
        )
        assert read_response(sock)[2] == b'{"n":50000}'


# --- timeouts --------------------------------------------------------------------------------
def test_a_slowloris_head_gets_408_after_the_header_timeout(server: Server) -> None:
    with connect(server.port) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\nx-slow: ")
        answer = b""
        sock.setblocking(False)
        while time.monotonic() - t0 < 3.0 and b"}" not in answer:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.send(b"a")
            time.sleep(0.05)
            with contextlib.suppress(BlockingIOError):
                answer += sock.recv(65536)
        sock.settimeout(TIMEOUT_S)
        status, _, body = read_response(sock, bytearray(answer))
        assert status == 408
        assert error_of(body)["message"] == "Request head not received within 0.5 s"
        assert 0.4 < time.monotonic() - t0 < 1.5


def test_a_slow_body_gets_408_after_the_body_timeout(server: Server) -> None:
    with connect(server.port) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /big HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\nabc")
        status, _, body = read_response(sock)
        assert status == 408 and "body" in error_of(body)["message"]
        assert 0.4 < time.monotonic() - t0 < 1.5


def test_idle_connections_are_closed(server: Server) -> None:
    with connect(server.port) as idle_keep_alive, connect(server.port) as silent:
        idle_keep_alive.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
        assert read_response(idle_keep_alive)[0] == 200
        assert 0.3 < closed_by_server(idle_keep_alive) < 1.5  # keep_alive_timeout_s 0.4
        assert closed_by_server(silent) < 1.5  # sent nothing: header_timeout_s 0.5, no answer


def test_a_client_that_stops_reading_is_aborted_and_its_stream_closed(
    server: Server, events: Events
) -> None:
    with connect(server.port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /firehose HTTP/1.1\r\nhost: t\r\n\r\n")
        assert events.wait_for("firehose closed") < 3.0  # write_timeout_s 0.4
    assert server.call(lambda: server.server.num_connections) == 0  # type: ignore[union-attr]


# --- the connection cap ----------------------------------------------------------------------
def test_past_the_cap_idle_ones_make_room_then_a_clear_refusal(
    server: Server, events: Events
) -> None:
    # eight idle keep-alive connections fill the cap: a new one is served, the oldest closed
    idle = [connect(server.port) for _ in range(8)]
    try:
        for sock in idle:
            sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
            assert read_response(sock)[0] == 200
        assert get_ok(server.port) < 0.5
        assert closed_by_server(idle[0], 1.0) < 1.0
    finally:
        for sock in idle:
            sock.close()
    # eight busy connections: the ninth gets 503 with Connection: close, in OpenAI's shape
    busy = [connect(server.port) for _ in range(8)]
    try:
        for sock in busy:
            sock.sendall(b"GET /wait HTTP/1.1\r\nhost: t\r\n\r\n")
        time.sleep(0.2)
        with connect(server.port) as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
            status, headers, body = read_response(sock)
            assert status == 503 and headers["connection"] == "close"
            assert "limit of 8 connections" in error_of(body)["message"]
        events.release.set()
        for sock in busy:
            assert read_response(sock)[2] == b"done"
    finally:
        for sock in busy:
            sock.close()
    time.sleep(0.2)
    assert get_ok(server.port) < 0.5  # served again once the others closed


def open_slow_heads(port: int, num: int) -> list[socket.socket]:
    """`num` connections that each sent the start of a request head, and nothing more."""
    socks = []
    for _ in range(num):
        sock = connect(port)
        socks.append(sock)
        with contextlib.suppress(OSError):  # (one shed at once is the server's right)
            sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\nx-slow: a")
    return socks


def test_slow_heads_at_the_cap_are_shed_for_working_clients(events: Events) -> None:
    # the header timeout is long: only the cap's shedding can make room
    app = make_app(events)
    app.limits = dataclasses.replace(LIMITS, header_timeout_s=30.0)
    srv = Server(app, "asyncio")
    slow: list[socket.socket] = []
    try:
        slow = open_slow_heads(srv.port, 8)  # the whole cap: 8 heads arriving a byte at a time
        time.sleep(0.4)  # older than NEW_CONNECTION_GRACE_S (a slow head is shed at any age)
        assert get_ok(srv.port) < 1.0  # it sheds the slowest head
        status, headers, body = read_response(slow[0])  # a clean 408 in OpenAI's shape
        assert status == 408 and headers["connection"] == "close"
        assert error_of(body)["message"] == (
            "Request head too slow: the server is at its limit of 8 connections"
        )
        assert closed_by_server(slow[0], 2.0) < 2.0  # then closed
        assert srv.call(lambda: srv.server.num_shed) == 1  # type: ignore[union-attr]
        # a client that reconnects its slow heads as fast as they are shed keeps nobody out
        for _ in range(5):
            slow += open_slow_heads(srv.port, 3)
            time.sleep(0.3)
            assert get_ok(srv.port) < 1.0
        assert srv.call(lambda: srv.server.num_refused) == 0  # type: ignore[union-attr]
        assert srv.call(lambda: srv.server.num_connections) <= 8  # type: ignore[union-attr]
    finally:
        for sock in slow:
            sock.close()
        srv.stop()


# --- pipelining ------------------------------------------------------------------------------
def test_a_pipelined_flood_is_not_buffered_without_bound(server: Server) -> None:
    num_requests = 1_000_000  # 19 MB, and 100 MB of answers: more than socket buffers hold
    request = b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n"
    with connect(server.port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.setblocking(False)
        out = memoryview(request * num_requests)
        sent = 0
        t0 = time.monotonic()
        while sent < len(out) and time.monotonic() - t0 < 0.3:  # under the write timeout
            try:
                sent += sock.send(out[sent:])
            except BlockingIOError:
                time.sleep(0.01)
        assert sent < len(out)

        def buffered() -> tuple[int, int]:
            conns = list(server.server._connections)  # type: ignore[union-attr]
            assert len(conns) == 1
            conn = conns[0]
            assert conn.transport is not None
            return len(conn._pending), conn.transport.get_write_buffer_size()

        num_pending, write_buffer_bytes = server.call(buffered)
        assert num_pending <= 8 + 65536 // len(request)  # the cap plus one read's worth
        assert write_buffer_bytes < 256 * 1024
        # a client that floods and never reads is dropped after the write timeout
        t0 = time.monotonic()
        while server.call(lambda: server.server.num_connections):  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 3.0, "a flooding client that never reads stays"
            time.sleep(0.05)


# --- HTTP/1.0 and HEAD -----------------------------------------------------------------------
def test_an_http10_client_gets_a_stream_without_chunks(server: Server) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        status, headers, body = read_response(sock)
        assert status == 200
        assert "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    with connect(server.port) as sock:
        sock.sendall(b"GET /push HTTP/1.0\r\n\r\n")
        status, headers, body = read_response(sock)
        assert "transfer-encoding" not in headers
        assert body == b"data: a\n\ndata: [DONE]\n\n"


def test_head_is_answered_like_get_without_a_body(server: Server, events: Events) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n")
        _, get_headers, get_body = read_response(sock)
        # HEAD then GET pipelined: the HEAD answer has the GET's head and no body at all
        sock.sendall(b"HEAD /a HTTP/1.1\r\nhost: t\r\n\r\nGET /a?x HTTP/1.1\r\nhost: t\r\n\r\n")
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            buf.extend(sock.recv(65536))
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert f"content-length: {len(get_body)}".encode() in head
        assert b"content-type: application/json" in head
        status, _, body = read_response(sock, bytearray(rest))  # the GET's answer follows
        assert status == 200 and body == b'{"path":"/a","query":"x"}'
        assert get_headers["content-length"] == str(len(get_body))
        # a stream route: the head only, and the producer is told
        sock.sendall(b"HEAD /push HTTP/1.1\r\nhost: t\r\n\r\nGET /a HTTP/1.1\r\nhost: t\r\n\r\n")
        buf = bytearray()
        while buf.count(b"\r\n\r\n") < 2:
            buf.extend(sock.recv(65536))
        assert bytes(buf).startswith(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        events.wait_for("push closed")
        # HEAD on a POST-only route is a 405 that names the allowed methods
        sock.sendall(b"HEAD /small HTTP/1.1\r\nhost: t\r\n\r\n")
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            buf.extend(sock.recv(65536))
        assert buf.startswith(b"HTTP/1.1 405") and b"allow: POST\r\n" in buf


# --- the disconnect contract -----------------------------------------------------------------
def test_a_client_that_leaves_cancels_its_handler(server: Server, events: Events) -> None:
    with connect(server.port) as sock:
        sock.sendall(b"GET /sleep?gone HTTP/1.1\r\nhost: t\r\n\r\n")
        time.sleep(0.1)
    assert events.wait_for("finally gone") < 1.0
    assert events.log.index("cancelled gone") < events.log.index("finally gone")
    # the same when the client half-closes, and when it leaves with requests queued behind
    with connect(server.port) as sock:
        sock.sendall(
            b"GET /sleep?queued HTTP/1.1\r\nhost: t\r\n\r\n"
            b"GET /sleep?never HTTP/1.1\r\nhost: t\r\n\r\n"
        )
        time.sleep(0.1)
        sock.shutdown(socket.SHUT_WR)
        assert events.wait_for("finally queued") < 1.0
    time.sleep(0.1)
    assert "finally never" not in events.log  # a queued request is dropped, not started
