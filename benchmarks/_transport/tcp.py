"""The raw TCP reference: a sender and a receiver process over 127.0.0.1, timed per trial."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .common import MB
from .lifetime import get_or_orphaned, orphan_watchdog


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            return out
        out += part
    return out


def _tcp_receiver(port_q: Any, bufsize: int) -> None:
    """Receives trials on one connection: an 8-byte length, that many bytes, then an 8-byte ack."""
    orphan_watchdog()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(bufsize))
    while True:
        head = _recv_exact(conn, 8)
        total = int.from_bytes(head, "little") if len(head) == 8 else 0
        if total == 0:
            break
        got = 0
        while got < total:
            n = conn.recv_into(buf, min(bufsize, total - got))
            if n == 0:
                return
            got += n
        conn.sendall(got.to_bytes(8, "little"))
    conn.close()
    srv.close()


def _tcp_sender(port: int, bufsize: int, cmd_q: Any, result_q: Any) -> None:
    orphan_watchdog()
    parent = os.getppid()
    payload = os.urandom(bufsize)
    s = socket.create_connection(("127.0.0.1", port))
    while True:
        total = get_or_orphaned(cmd_q, parent)
        if total is None:
            s.sendall((0).to_bytes(8, "little"))
            break
        t0 = time.perf_counter()
        s.sendall(total.to_bytes(8, "little"))
        sent = 0
        while sent < total:
            s.sendall(payload)
            sent += len(payload)
        ack = _recv_exact(s, 8)
        t1 = time.perf_counter()
        result_q.put((int.from_bytes(ack, "little") if len(ack) == 8 else -1, t1 - t0))
    s.close()


class TcpPair:
    """A sender and a receiver process over 127.0.0.1 (1 MiB ``sendall`` / ``recv_into``)."""

    def __init__(self, ctx: Any, bufsize: int = 1 << 20) -> None:
        self.bufsize = bufsize
        port_q, self.cmd_q, self.result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.rx = ctx.Process(target=_tcp_receiver, args=(port_q, bufsize), daemon=True, name="bench-tcp-receiver")
        self.rx.start()
        port = port_q.get(timeout=120)
        self.tx = ctx.Process(
            target=_tcp_sender, args=(port, bufsize, self.cmd_q, self.result_q), daemon=True, name="bench-tcp-sender"
        )
        self.tx.start()

    def trial(self, nbytes: int) -> dict[str, float]:
        total = -(-nbytes // self.bufsize) * self.bufsize  # whole buffers
        self.cmd_q.put(total)
        got, secs = self.result_q.get(timeout=300)
        if got != total:
            raise RuntimeError(f"raw TCP: the receiver counted {got} of {total} bytes")
        return {
            "bytes": total,
            "seconds": round(secs, 4),
            "MBps": round(total / secs / MB, 1),
            "t": round(time.monotonic(), 3),
        }

    def close(self) -> None:
        if self.tx.is_alive():
            self.cmd_q.put(None)
        for p in (self.tx, self.rx):
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
