"""Run as a process: flood a CURVE client's socket monitor with refused handshakes, then stop the monitor.

What it knows: how to make a DEALER that fails its CURVE handshake with several routers as fast as libzmq
reconnects (1 ms), and how to queue more monitor events than libzmq's default pipe holds (1,000 + 1,000)
before stopping the monitor with `kvfence.auth.curve`. A monitor that makes libzmq's I/O thread wait freezes
this process with the GIL held, so the test that runs it can only see that from outside, as a timeout.

What it does not know: the router or worker classes; it drives the sockets directly.

Prints one line, `events N`: how many events the stop handed to its drain.
"""

from __future__ import annotations

import sys
import time

import zmq

from kvfence.auth.curve import CurveKeys, make_client, open_monitor, stop_monitor
from kvfence.auth.keys import ClusterKey

TARGET_EVENTS = 4_000  # twice what a default monitor pipe holds before libzmq's sender blocks
MAX_WAIT_S = 30.0


def main(routers: int) -> None:
    ctx = zmq.Context()
    theirs = CurveKeys.from_cluster_key(ClusterKey.generate())
    ours = CurveKeys.from_cluster_key(ClusterKey.generate())  # another cluster key: every handshake fails
    servers = []
    for _ in range(routers):
        srv = ctx.socket(zmq.ROUTER)
        srv.setsockopt(zmq.LINGER, 0)
        srv.curve_secretkey = theirs.server_secret
        srv.curve_publickey = theirs.server_public
        srv.curve_server = True
        servers.append((srv, srv.bind_to_random_port("tcp://127.0.0.1")))
    cli = ctx.socket(zmq.DEALER)
    cli.setsockopt(zmq.LINGER, 0)
    cli.setsockopt(zmq.RECONNECT_IVL, 1)
    make_client(cli, ours)
    mask = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    monitor = open_monitor(cli, mask)
    for _, port in servers:
        cli.connect(f"tcp://127.0.0.1:{port}")

    # Calibrate: count (and so drain) one second of events, then let TARGET_EVENTS queue up undrained.
    seen, end = 0, time.monotonic() + 1.0
    while time.monotonic() < end:
        if monitor.poll(50, zmq.POLLIN):
            monitor.recv_multipart()
            seen += 1
    time.sleep(min(MAX_WAIT_S, TARGET_EVENTS / max(seen, 1)))

    drained = 0

    def drain() -> None:
        nonlocal drained
        while monitor.poll(0, zmq.POLLIN):
            monitor.recv_multipart(zmq.NOBLOCK)
            drained += 1

    stop_monitor(cli, drain)
    monitor.close(0)
    cli.close(0)
    for srv, _ in servers:
        srv.close(0)
    ctx.term()
    print(f"events {drained}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
