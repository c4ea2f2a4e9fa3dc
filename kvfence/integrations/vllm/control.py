"""A small request/reply channel between kvfence's vLLM connectors and its front end, authenticated by a key.

What it knows: one exchange per connection, framed like kvfence's data plane
(`u32 header_len | u32 payload_len | header JSON`, little-endian, no payload), its messages typed in
`control_messages` (a header is one of them as a JSON object, `to_header`):

    server -> client   Hello {"t": "hello", "nonce": <32 hex digits>}
    client -> server   the request, e.g. Pull {"t": "pull", ...} or Record {"t": "record", ...}, plus "mac" when keyed
    server -> client   the reply, Ok {"t": "ok", ...} or Refused {"t": "refused", "reason": ...}

The client's "mac" is HMAC-SHA256 under a key derived from the deployment's cluster key (`control_key`), over the
server's fresh nonce and the request's canonical JSON (sorted keys, no spaces), so a request cannot be forged
without the key nor replayed on another connection; a request without a valid mac is refused before the handler
sees it, and counted. Headers are capped (`MAX_HEADER_BYTES`) before anything is allocated for them, every
socket carries a timeout, and a malformed frame ends the connection, never the server. (A server or client given
no key skips the mac: tests only.)

What it does not know: what a request means (the handlers in handoff.py and proxy.py decide).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from kvfence.auth.keys import ClusterKey
from kvfence.errors import KvfenceError
from kvfence.integrations.vllm.control_messages import Hello, MessageError, Refused, hello_from, to_header

logger = logging.getLogger(__name__)

_PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 16384  # an integrity record is ~1 KiB

Header = dict[str, Any]
Handler = Callable[[Header, str], Header]  # (request, peer host) -> reply


class ControlError(KvfenceError):
    """A control exchange that could not complete (no server, refused, malformed reply, timeout)."""


def control_key(key: ClusterKey) -> bytes:
    """The key of this channel, derived from the deployment's cluster key (`auth.keys`: one key per purpose)."""
    return key.derive("vllm-control")


def _canonical(header: Header) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _mac(key: bytes, nonce: str, header: Header) -> str:
    body = {k: v for k, v in header.items() if k != "mac"}
    return hmac.new(key, nonce.encode() + b"\n" + _canonical(body), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, header: Header) -> None:
    hb = json.dumps(header, separators=(",", ":")).encode()
    if len(hb) > MAX_HEADER_BYTES:
        raise ControlError(f"control header of {len(hb)} bytes is over {MAX_HEADER_BYTES}")
    sock.sendall(_PREFIX.pack(len(hb), 0) + hb)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ControlError("the peer closed the control connection mid-frame")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Header:
    hlen, plen = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size))
    if plen != 0 or not 0 < hlen <= MAX_HEADER_BYTES:  # checked before anything is allocated for it
        raise ControlError(f"malformed control frame (header {hlen} bytes, payload {plen})")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ControlError(f"control header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ControlError("control header is not a JSON object")
    return header


def parse_tcp_address(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ControlError(f"not a tcp:// address: {address!r}")
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


def request(address: str, header: Header, key: bytes | None, timeout_s: float = 5.0) -> Header:
    """One exchange with the control server at `address`: send `header`, return its reply (raises ControlError)."""
    try:
        with socket.create_connection(parse_tcp_address(address), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = _recv(sock)
            try:
                nonce = hello_from(greeting).nonce
            except MessageError as e:
                raise ControlError(f"control server at {address} did not greet: {e}: {greeting!r:.200}") from None
            out = dict(header)
            if key is not None:
                out["mac"] = _mac(key, nonce, header)
            _send(sock, out)
            return _recv(sock)
    except (OSError, ValueError, struct.error) as e:
        raise ControlError(f"control exchange with {address} failed: {e}") from None


class ControlServer:
    """Serves control requests on host:port (0 picks a free port), one thread per connection."""

    def __init__(
        self, handler: Handler, key: bytes | None, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 5.0
    ) -> None:
        self.handler, self.key, self.timeout_s = handler, key, timeout_s
        self._listener = socket.create_server((host, port))
        self.address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        self.refused_auth = 0  # requests dropped for a missing or wrong mac (security events)
        self.malformed = 0
        self.closed = False
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._accept_loop, name="kvfence-control-accept", daemon=True)
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock, str(peer[0])), name="kvfence-control", daemon=True)
            with self._lock:
                self._threads = {x for x in self._threads if x.is_alive()} | {t}
            t.start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        with sock:
            try:
                sock.settimeout(self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_hex(16)
                _send(sock, to_header(Hello(nonce)))
                header = _recv(sock)
                if self.key is not None:
                    mac = header.get("mac")
                    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.key, nonce, header)):
                        self.refused_auth += 1
                        logger.warning("kvfence control: refused an unauthenticated %r request from %s",
                                       str(header.get("t"))[:40], peer)  # fmt: skip
                        _send(sock, to_header(Refused("not authenticated")))
                        return
                header.pop("mac", None)
                try:
                    reply = self.handler(header, peer)
                except Exception as e:  # a handler bug must not take the server down; the client learns why
                    logger.exception("kvfence control: handler failed on %r", str(header.get("t"))[:40])
                    reply = to_header(Refused(f"internal error: {type(e).__name__}"))
                _send(sock, reply)
            except (OSError, ControlError, struct.error) as e:
                self.malformed += 1
                logger.debug("kvfence control: dropped a connection from %s: %s", peer, e)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accept.join(timeout=5)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=self.timeout_s + 1)
