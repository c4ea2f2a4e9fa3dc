"""The data plane's handshake and frame MACs: a connection proves it holds the cluster key before anything else.

What it knows: the mutual challenge-response every data connection (TCP transport, and the Mooncake
backend's control link) runs right after connect, before the receiver reads a single frame or
allocates anything for the peer:

    receiver -> sender   MAGIC (8 bytes) | nonce_r (32)
    sender -> receiver   nonce_s (32) | HMAC(k, "sender" | MAGIC | nonce_r | nonce_s)       (32)
    receiver -> sender   HMAC(k, "receiver" | MAGIC | nonce_r | nonce_s)                    (32)

with k = the cluster key's "data-plane" key (HMAC-SHA256). The receiver checks the sender's tag in
constant time and drops the connection when it fails (a security event); the sender checks the
receiver's, so prefill never sends a prompt's KV to an impostor. Both then derive one key per
direction from the two nonces, and every frame that follows carries a 16-byte tag,
HMAC(k_dir, seq | frame prefix | header)[:16], over a per-direction frame counter: a frame that is
injected, altered, reordered or replayed (on this connection or, since the nonces are fresh, on any
other) fails its MAC and the connection is dropped. Page payloads are not MAC'd frame by frame:
their bytes are covered by the per-page digests, which the manifest's own MAC covers
(`integrity.manifest.seal`).

What it does not know: sockets beyond `recv`/`sendall` of a connected one, or frames' meaning
(`transfer.tcp`). Nothing here is encrypted: the data plane is authenticated, not confidential
(docs/handoff.md, "Trust model").
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time

from kvfence.errors import KvfenceError

MAGIC = b"KVFD\x00\x01\x00\x00"  # kvfence data plane, protocol 1
NONCE_BYTES = 32
TAG_BYTES = 32
FRAME_TAG_BYTES = 16
_SEQ = struct.Struct("<Q")


class HandshakeError(KvfenceError, ConnectionError):
    """The peer did not prove it holds the cluster key (or spoke something else): the connection is dropped."""


def _tag(key: bytes, label: bytes, nonce_r: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(key, label + MAGIC + nonce_r + nonce_s, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes by `deadline` (time.monotonic()) for all of them, not per read: a peer dribbling a byte at a
    time would otherwise hold one of the receiver's few pending-handshake places for minutes."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        got = sock.recv(n - len(buf))
        if not got:
            raise HandshakeError(f"peer closed the connection during the handshake ({len(buf)}/{n} bytes)")
        buf += got
    return bytes(buf)


class FrameMac:
    """The per-direction frame MACs of one authenticated connection.

    `sign` is called under the connection's write lock (one writer at a time), `check` by its one
    reader; each keeps its own counter, so a frame's tag is valid only at its place in its stream."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send = hmac.new(send_key, digestmod=hashlib.sha256)
        self._recv = hmac.new(recv_key, digestmod=hashlib.sha256)
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()

    def sign(self, prefix: bytes, header: bytes) -> bytes:
        with self._lock:
            h = self._send.copy()
            h.update(_SEQ.pack(self._send_seq))
            self._send_seq += 1
        h.update(prefix)
        h.update(header)
        return h.digest()[:FRAME_TAG_BYTES]

    def check(self, prefix: bytes, header: bytes, tag: bytes) -> bool:
        h = self._recv.copy()
        h.update(_SEQ.pack(self._recv_seq))
        self._recv_seq += 1
        h.update(prefix)
        h.update(header)
        return hmac.compare_digest(h.digest()[:FRAME_TAG_BYTES], tag)


def _session(key: bytes, nonce_r: bytes, nonce_s: bytes, receiver: bool) -> FrameMac:
    to_receiver = _tag(key, b"frames sender->receiver", nonce_r, nonce_s)
    to_sender = _tag(key, b"frames receiver->sender", nonce_r, nonce_s)
    return FrameMac(to_sender, to_receiver) if receiver else FrameMac(to_receiver, to_sender)


def accept(sock: socket.socket, key: bytes, timeout_s: float) -> FrameMac:
    """Receiver side, on a freshly accepted socket: challenge the peer; its frames' MACs on success.

    Raises HandshakeError (wrong key, not a kvfence sender, too slow) or OSError; reads at most
    NONCE_BYTES + TAG_BYTES bytes from the peer whatever it sends."""
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout_s  # for the whole handshake
    sock.settimeout(timeout_s)
    try:
        nonce_r = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + nonce_r)
        answer = _recv_exact(sock, NONCE_BYTES + TAG_BYTES, deadline)
        nonce_s, tag_s = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(tag_s, _tag(key, b"sender", nonce_r, nonce_s)):
            raise HandshakeError("the peer's handshake tag is wrong: it does not hold this deployment's cluster key")
        sock.sendall(_tag(key, b"receiver", nonce_r, nonce_s))
    except TimeoutError:
        raise HandshakeError(f"no handshake answer within {timeout_s:g}s") from None
    finally:
        sock.settimeout(old)
    return _session(key, nonce_r, nonce_s, receiver=True)


def connect(sock: socket.socket, key: bytes, timeout_s: float) -> FrameMac:
    """Sender side, on a freshly connected socket: answer the receiver's challenge and check its proof."""
    old = sock.gettimeout()
    deadline = time.monotonic() + timeout_s  # for the whole handshake
    sock.settimeout(timeout_s)
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
        if hello[: len(MAGIC)] != MAGIC:
            raise HandshakeError("the receiver does not speak kvfence's data-plane protocol 1")
        nonce_r, nonce_s = hello[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES)
        sock.sendall(nonce_s + _tag(key, b"sender", nonce_r, nonce_s))
        try:
            proof = _recv_exact(sock, TAG_BYTES, deadline)
        except HandshakeError:
            raise HandshakeError(
                "the receiver hung up on our proof: it holds another cluster key (is every process of the deployment "
                "given the same --cluster-key-file?)"
            ) from None
        if not hmac.compare_digest(proof, _tag(key, b"receiver", nonce_r, nonce_s)):
            raise HandshakeError("the receiver's handshake proof is wrong: it does not hold this cluster key")
    except TimeoutError:
        raise HandshakeError(f"no handshake from the receiver within {timeout_s:g}s") from None
    finally:
        sock.settimeout(old)
    return _session(key, nonce_r, nonce_s, receiver=False)
