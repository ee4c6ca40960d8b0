"""The host's header proxy: sets a policy's headers on the guest's HTTP and HTTPS requests
to the destinations it names (:class:`~cryobox.network.policy.HeaderRule`), so that a
secret (an API key, a token) reaches the destination without ever entering the guest.

How a connection gets here: the sandbox's namespace sends the guest's connections to
ports 80 and 443 of a rule's addresses to this proxy (a DNAT in its nftables table,
:func:`cryobox.network.namespace._sandbox_rules`), which listens inside that namespace
at ``HEADER_PROXY``. It dials the destination from the namespace too, its sockets marked
(``HEADER_MARK``) so they are not sent back to itself, and so the policy's filter judges
its connection as it would the guest's: setting headers for a destination allows
nothing.

On each connection it reads the first bytes without taking them. A TLS ClientHello
whose server name (or, without one, whose address) no rule matches is passed on as it
is, unread: another site on a shared address keeps its end-to-end TLS. One a rule
matches is ended here, with a certificate for that name signed by the host's egress CA
(:mod:`.egress_ca`; a guest whose policy sets headers trusts it), and its requests go
to the destination over a TLS connection of the proxy's own, verified against the
host's system CAs and the sandbox's extra ones (``ca_bundle``). Plain HTTP is read as
it comes, and a request whose ``Host`` a rule names gets its headers.

Requests are read one at a time with h11 (HTTP/1.1: the proxy offers no HTTP/2) and
sent on with the rule's headers, each replacing one of its name; answers pass back as
they come (an upgrade to a WebSocket too). A destination that cannot be reached, or
whose certificate does not verify, is answered ``502`` naming why, once the guest's
TLS is up, rather than a bare reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import h11

from cryobox.network import egress_ca
from cryobox.network.forward import in_own_thread, pump
from cryobox.network.namespace import HEADER_MARK, HEADER_PROXY, socket_inside
from cryobox.network.policy import HeaderRule

log = logging.getLogger("cryobox.supervisor")

CHUNK = 64 * 1024
#: How long a guest may take to send its first bytes, and the proxy to reach a destination.
HELLO_TIMEOUT = 10.0
CONNECT_TIMEOUT = 10.0
#: How long a connection's end may take (its last bytes, TLS's close_notify).
CLOSE_TIMEOUT = 5.0
#: Connections one proxy serves at once (more are closed as they come).
MAX_CONNECTIONS = 256
_SO_ORIGINAL_DST = 80
Headers = tuple[tuple[str, str], ...]
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class HeaderProxy:
    """One per sandbox whose policy sets headers, owned by its supervisor. ``rules`` may
    be replaced at any time (a policy changed while the sandbox runs): a request is
    matched when it arrives.

    ``namespace`` is an open descriptor of the sandbox's network namespace (the proxy
    owns it), or None for this process's own (a test). ``destination`` says where an
    accepted connection was going (default: what the namespace's DNAT recorded)."""

    def __init__(
        self,
        namespace: int | None,
        *,
        trust: Path | None = None,
        listen: tuple[str, int] = HEADER_PROXY,
        destination: Callable[[socket.socket], tuple[str, int]] | None = None,
    ) -> None:
        self.rules: tuple[HeaderRule, ...] = ()
        self.port = 0
        self._namespace = namespace
        self._trust = trust
        self._listen = listen
        self._destination = destination or original_destination
        self._authority: egress_ca.Authority | None = None
        self._verify: tuple[int, ssl.SSLContext] | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen (inside the namespace), the egress CA loaded or made.

        :raises OSError: when it cannot listen (its address is taken).
        """
        self._authority = await asyncio.to_thread(egress_ca.load)
        listener = await self._socket()
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(self._listen)
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(listener))

    async def close(self) -> None:
        """Stop listening and cut every connection under way."""
        tasks = [*self._tasks, *([self._accepting] if self._accepting else [])]
        self._accepting = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._namespace is not None:
            os.close(self._namespace)
            self._namespace = None

    async def _socket(self) -> socket.socket:
        if self._namespace is None:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        return await in_own_thread(socket_inside, os.dup(self._namespace))

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with listener:
            while True:
                try:
                    client, _ = await loop.sock_accept(listener)
                except OSError as exc:  # out of descriptors, say: the listener stays
                    log.warning("header proxy: accepting failed: %s", exc)
                    await asyncio.sleep(0.1)
                    continue
                if len(self._tasks) >= MAX_CONNECTIONS:
                    client.close()
                    continue
                task = asyncio.create_task(self._serve(client))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve(self, client: socket.socket) -> None:
        try:
            with client:
                client.setblocking(False)
                host, port = self._destination(client)
                # Only what the namespace sent here for a rule (never the proxy itself).
                if (host, port) == self._listen or not self._covers(host):
                    return
                first = await _peek(client)
                if first[:1] == b"\x16":  # a TLS handshake
                    name = server_name(first)
                    if self._match(name, host) is None:
                        await self._pass_on(client, host, port)
                    else:
                        await self._end_tls(client, host, port, name)
                elif first:
                    await self._plain(client, host, port)
        except (OSError, TimeoutError, h11.ProtocolError, ssl.SSLError) as exc:
            log.info("header proxy: a connection ended: %s", exc)
        except Exception:  # what a hostile guest sends ends its connection, nothing else
            log.exception("header proxy: a connection failed")

    def _covers(self, address: str) -> bool:
        where = ipaddress.ip_address(address)
        return any(rule.reaches(where) for rule in self.rules)

    def _match(self, name: str | None, address: str) -> HeaderRule | None:
        """The rule for a request to ``address`` for ``name`` (a TLS server name or a
        ``Host``): one whose addresses hold ``address``, and, for a rule by name, of
        that name (so a ``Host`` naming one rule never gets its headers sent to another
        rule's destination)."""
        where = ipaddress.ip_address(address)
        for rule in self.rules:
            if rule.reaches(where) and (not rule.is_name or name == rule.host):
                return rule
        return None

    def _headers_for(self, request: h11.Request, address: str, tls_name: str | None) -> Headers:
        """The headers to set on ``request``, looked up as it arrives (a rule changed
        or removed meanwhile is in force at the connection's next request).

        :raises Refused: for a request on a connection the proxy ended TLS for whose
            ``Host`` names another site than its server name (domain fronting), and for
            one that would get headers but names its destination in the request line.
        """
        host = host_of(request)
        if tls_name is not None and host is not None and host != tls_name:
            raise Refused(421, f"this connection is for {tls_name}, not {host}")
        rule = self._match(host or tls_name, address)
        if rule is None:
            return ()
        if not request.target.startswith(b"/"):
            raise Refused(400, "a request given headers must name a path, not a URL")
        return rule.headers

    async def _dial(self, host: str, port: int) -> socket.socket:
        sock = await self._socket()
        try:
            if self._namespace is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, HEADER_MARK)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(sock, (host, port)), CONNECT_TIMEOUT)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _pass_on(self, client: socket.socket, host: str, port: int) -> None:
        """Join the guest's connection to the destination, unread."""
        upstream = await self._dial(host, port)
        reader, writer = await asyncio.open_connection(sock=client)
        up_reader, up_writer = await asyncio.open_connection(sock=upstream)
        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def _plain(self, client: socket.socket, host: str, port: int) -> None:
        reader, writer = await asyncio.open_connection(sock=client)

        async def reach() -> Streams:
            return await asyncio.open_connection(sock=await self._dial(host, port))

        await self._carry(reader, writer, reach, f"{host}:{port}", host, None)

    async def _end_tls(self, client: socket.socket, host: str, port: int, name: str | None) -> None:
        assert self._authority is not None
        shown = name or host
        context = await asyncio.to_thread(self._authority.server_context, shown)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=CHUNK)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, client, ssl=context, ssl_handshake_timeout=HELLO_TIMEOUT
        )
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)

        async def reach() -> Streams:
            upstream = await self._dial(host, port)
            verifying = await self._verifying()
            return await asyncio.wait_for(
                asyncio.open_connection(sock=upstream, ssl=verifying, server_hostname=shown),
                CONNECT_TIMEOUT,
            )

        await self._carry(reader, writer, reach, f"https://{shown}:{port}", host, name)

    async def _carry(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        reach: Callable[[], Awaitable[Streams]],
        where: str,
        address: str,
        tls_name: str | None,
    ) -> None:
        """Relay the guest's requests to the destination ``reach()`` connects to (``where``
        names it in a 502 when it cannot), then close both ends."""
        try:
            try:
                up_reader, up_writer = await reach()
            except (OSError, TimeoutError) as exc:  # (ssl.SSLError is an OSError)
                await _refuse(writer, f"cannot reach {where}: {_why(exc)}")
                return
            try:
                await relay(
                    reader,
                    writer,
                    up_reader,
                    up_writer,
                    lambda request: self._headers_for(request, address, tls_name),
                    tls_name or address,
                )
            finally:
                await _close(up_writer)
        finally:
            await _close(writer)

    async def _verifying(self) -> ssl.SSLContext:
        """The host's system CAs and the sandbox's extra ones (made again when those
        change)."""
        stamp = -1
        with contextlib.suppress(OSError):
            stamp = self._trust.stat().st_mtime_ns if self._trust else -1
        if self._verify is None or self._verify[0] != stamp:

            def make() -> ssl.SSLContext:
                context = ssl.create_default_context()
                if stamp != -1 and self._trust is not None:
                    context.load_verify_locations(cafile=str(self._trust))
                context.set_alpn_protocols(["http/1.1"])
                return context

            self._verify = (stamp, await asyncio.to_thread(make))
        return self._verify[1]


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a connection the namespace's DNAT sent here was going."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def woken() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), woken)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _peek(sock: socket.socket) -> bytes:
    """The first bytes the guest sent, left to be read: a whole TLS record when it
    starts one (its ClientHello), else what came first. b"": it closed. (A guest that
    sends nothing costs nothing until then; a record that comes in parts is looked at
    again every 10 ms.)"""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HELLO_TIMEOUT
    await asyncio.wait_for(_readable(sock), HELLO_TIMEOUT)
    while True:
        try:
            data = sock.recv(16 * 1024 + 5, socket.MSG_PEEK)
        except BlockingIOError:
            data = None
        whole = data is not None and len(data) >= 5 + int.from_bytes(data[3:5])
        if data is not None and (data[:1] != b"\x16" or whole):
            return data
        if loop.time() > deadline:
            raise TimeoutError("the guest sent no whole first message")
        await asyncio.sleep(0.01)


def server_name(hello: bytes) -> str | None:
    """The server name (SNI) a TLS ClientHello asks for, lowercased; None when it names
    none or is not one."""
    try:
        if hello[0] != 0x16:
            return None
        body = hello[5 : 5 + int.from_bytes(hello[3:5])]
        if body[0] != 1:  # not a ClientHello
            return None
        pos = 4 + 2 + 32  # its header, version, random
        pos += 1 + body[pos]  # session id
        pos += 2 + int.from_bytes(body[pos : pos + 2])  # cipher suites
        pos += 1 + body[pos]  # compression methods
        end = min(len(body), pos + 2 + int.from_bytes(body[pos : pos + 2]))
        pos += 2
        while pos + 4 <= end:
            kind = int.from_bytes(body[pos : pos + 2])
            size = int.from_bytes(body[pos + 2 : pos + 4])
            pos += 4
            if kind == 0 and body[pos + 2] == 0:  # server_name, of type host_name
                length = int.from_bytes(body[pos + 3 : pos + 5])
                return body[pos + 5 : pos + 5 + length].decode("ascii").lower().rstrip(".")
            pos += size
    except (IndexError, UnicodeDecodeError):
        return None
    return None


class Refused(Exception):
    """A request the proxy does not send on: answered ``status``, saying ``why``."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


def host_of(request: h11.Request) -> str | None:
    """The name a request's ``Host`` gives (no port, lowercased), if it has one."""
    value = dict(request.headers).get(b"host")
    if value is None:
        return None
    host = value.decode("latin-1").lower()
    if not host.endswith("]"):  # [IPv6] keeps its colons
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".") or None


async def relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    headers_for: Callable[[h11.Request], Headers],
    host: str,
) -> None:
    """Carry HTTP requests from the guest (``reader``/``writer``) to the destination
    (``up_*``) one at a time, each with ``headers_for(request)`` set, and their answers
    back, until either side closes. ``host`` is the destination's name or address (the
    ``Host`` of an HTTP/1.0 request that gave none)."""
    guest = h11.Connection(h11.SERVER)
    destination = h11.Connection(h11.CLIENT)
    while True:
        request = await _next(guest, reader)
        if not isinstance(request, h11.Request):
            return
        try:
            sent = forwarded(request, headers_for(request), host)
            up_writer.write(destination.send(sent))
        except Refused as refused:
            await _refuse(writer, refused.why, status=refused.status)
            return
        except h11.LocalProtocolError:  # (never its text: it may quote a header's value)
            await _refuse(writer, "this request cannot be sent on as HTTP/1.1", status=400)
            return
        body = asyncio.create_task(_copy_body(guest, reader, destination, up_writer))
        try:
            switched = await _copy_answer(destination, up_reader, guest, writer)
        finally:
            if not body.done():
                body.cancel()
            with contextlib.suppress(BaseException):
                await body
        if switched:  # a WebSocket, say: bytes from now on
            up_writer.write(guest.trailing_data[0])
            writer.write(destination.trailing_data[0])
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
            return
        if body.cancelled() or h11.MUST_CLOSE in (guest.our_state, destination.our_state):
            return
        try:
            guest.start_next_cycle()
            destination.start_next_cycle()
        except h11.LocalProtocolError:
            return


def forwarded(request: h11.Request, headers: Headers, host: str) -> h11.Request:
    """``request`` as the proxy sends it on: ``headers`` set, each replacing those of its
    name; no ``Content-Length`` beside a ``Transfer-Encoding`` (RFC 9112 6.1: a sender
    must not send both, and a destination that reads the length would take the rest of
    the body for a second request); an HTTP/1.0 request as HTTP/1.1 asking to close
    after it (with ``host`` for the ``Host`` it may lack)."""
    raw = request.headers.raw_items()
    present = {name.lower() for name, _ in raw}
    dropped = {name.lower().encode() for name, _ in headers}
    if b"transfer-encoding" in present:
        dropped.add(b"content-length")
    added = [(name.encode(), value.encode()) for name, value in headers]
    if request.http_version != b"1.1":
        dropped.add(b"connection")
        added.append((b"Connection", b"close"))
        if b"host" not in present:
            added.append((b"Host", host.encode()))
    kept = [(name, value) for name, value in raw if name.lower() not in dropped]
    return h11.Request(method=request.method, target=request.target, headers=[*kept, *added])


async def _next(connection: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(CHUNK))
            continue
        return event


async def _copy_body(
    guest: h11.Connection,
    reader: asyncio.StreamReader,
    destination: h11.Connection,
    up_writer: asyncio.StreamWriter,
) -> None:
    while True:
        event = await _next(guest, reader)
        if isinstance(event, h11.Data | h11.EndOfMessage):
            up_writer.write(destination.send(event))
            await up_writer.drain()
        if not isinstance(event, h11.Data):
            return


async def _copy_answer(
    destination: h11.Connection,
    up_reader: asyncio.StreamReader,
    guest: h11.Connection,
    writer: asyncio.StreamWriter,
) -> bool:
    """Pass one answer back; True when it switched protocols (101)."""
    while True:
        event = await _next(destination, up_reader)
        if isinstance(event, h11.InformationalResponse | h11.Response | h11.Data):
            writer.write(guest.send(event))
            await writer.drain()
            if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                return True
        elif isinstance(event, h11.EndOfMessage):
            writer.write(guest.send(event))
            await writer.drain()
            return False
        else:  # the destination closed mid-answer
            raise ConnectionError("the destination closed before its answer ended")


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close, letting what was written (an answer, TLS's close_notify) go first: the
    socket closed under it would reset the connection, and the peer lose the answer."""
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT)


async def _refuse(writer: asyncio.StreamWriter, why: str, status: int = 502) -> None:
    body = f"cryobox header proxy: {why}\n".encode()
    reason = b"Bad Gateway" if status == 502 else b"Bad Request"
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )
    with contextlib.suppress(OSError):
        await writer.drain()


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
