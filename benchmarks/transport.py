#!/usr/bin/env python
"""Transport benchmark: model uploads over loopback gRPC against the real ``wafl server``.

Run from the repository root (about 2-5 minutes, most of it starting processes)::

    python benchmarks/transport.py            # writes benchmarks/results/transport.json

Everything runs in one go on this machine, each server and client in its own process:

* raw TCP over 127.0.0.1: a sender and a receiver process, one connection, 1 MiB ``sendall`` /
  ``recv_into``, 1 GiB per trial, three trials before and three after the gRPC phases, and one
  512 MiB trial right before each single-client upload;
* one client uploading the 11.2M-parameter float32 model (``resnet18``, ``code_len`` 32 on
  synthetic CIFAR-10 shapes: 44.8 MB) to a server with ``num_clients=1``, one upload per round:
  the time from the call to ``Session.upload`` to its return (the server acknowledges once every
  chunk is checked and folded into the running sum). The pass/fail ratio is the median over the
  uploads of upload MB/s over the MB/s of the TCP trial run just before it, so that both figures
  see the same machine load;
* ten clients uploading at the same moment (released together by one ``multiprocessing.Event``
  once every one of them holds the round's broadcast), on two fresh servers: per-client MB/s, aggregate MB/s (all
  bytes / first start to last finish), and the server's resident memory: idle ``VmRSS`` right
  before the uploads, then ``VmHWM`` after them (the peak is reset with ``/proc/<pid>/clear_refs``
  = 5 right before). An eleventh joined client holds its own upload back until the peak has been
  read, so the round stays open and the reading covers the ten uploads only, not the
  aggregation, broadcast and evaluation that follow a round's last upload. A server's first
  round is the one that shows its peak (later rounds start from an idle RSS that already holds
  what the first one left behind), hence fresh servers; the worst of them is the figure;
* a no-op round: five clients that upload the model they receive at once; round 2 is timed,
  from the clients' side (first receipt of its broadcast header to the last client holding the
  next broadcast) and by the server's own ``round_s`` in ``results.jsonl``;
* what limits the figures: the server's CPU time per thread during the uploads; a cProfile of
  one client upload; the same tensor messages (159 chunks grouped into 50 messages) through a bare ``grpc.aio``
  stream (plain, and with an awaited thread-pool hand-off per message, the cost one thread hop per message would add;
  wafl's handler instead queues chunks to a fold thread without awaiting); the cost of each step
  of the chunk path measured in-process; and diagnostic runs against a server changed at
  start-up by a ``sitecustomize`` module (product files untouched): ``bdp-probe`` (gRPC's
  per-stream receive windows grown from its bandwidth-delay estimate, gRPC's default) and
  ``server-stage-times`` (the server's own chunk-path functions timed during real uploads).

Benchmark clients use ``wafl.client.session.Session``, the transport real clients use; they do
not train and upload the received global state as is. No run reaches its last round (which
evaluates the model): clients stop at the broadcast after their last measured round and the
server is stopped. MB = 10^6 bytes throughout.

This file is the command line; the workloads, the servers, the phases, the report and the rest are
modules of ``benchmarks/_transport/`` (its ``__init__`` lists them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _transport.common import RESULTS
from _transport.diagnostics import DEFAULT_DIAGNOSTICS, DIAGNOSTICS, check_stage_wraps
from _transport.run import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tcp-bytes", type=int, default=1 << 30, help="bytes per raw TCP trial (default 1 GiB)")
    ap.add_argument("--tcp-trials", type=int, default=3, help="raw TCP trials before and again after the gRPC phases")
    ap.add_argument(
        "--tcp-paired-bytes",
        type=int,
        default=1 << 29,
        help="bytes of the raw TCP trial run right before each single-client upload (default 512 MiB)",
    )
    ap.add_argument("--single-uploads", type=int, default=9, help="measured single-client uploads (one per round)")
    ap.add_argument("--concurrent", type=int, default=10)
    ap.add_argument(
        "--concurrent-runs",
        type=int,
        default=2,
        help="fresh servers for the concurrent uploads (the first round of a server is the one that shows its peak)",
    )
    ap.add_argument("--concurrent-rounds", type=int, default=1, help="rounds of concurrent uploads per server")
    ap.add_argument("--keep", action="store_true", help="keep the server output folders")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a target is missed (default: 0 once the measurements are written)",
    )
    ap.add_argument(
        "--diagnostics",
        default=DEFAULT_DIAGNOSTICS,
        help=(
            "comma-separated extra runs against a server modified at start-up (product files untouched), "
            f"from {sorted(DIAGNOSTICS)}, or 'none' (default: {DEFAULT_DIAGNOSTICS})"
        ),
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every phase at a tiny size (20 MB TCP trials, 1 upload, 2 concurrent clients, one fresh server, the "
        "server-stage-times diagnostic): checks the script, not the machine; JSON to --out (default: a smoke file)",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.tcp_bytes, a.tcp_trials, a.tcp_paired_bytes = 20_000_000, 1, 10_000_000
        a.single_uploads, a.concurrent, a.concurrent_runs, a.concurrent_rounds = 1, 2, 1, 1
        a.diagnostics = "server-stage-times"
        if a.out == RESULTS:
            a.out = RESULTS.with_name("transport-smoke.json")
    if "server-stage-times" in a.diagnostics.split(","):
        check_stage_wraps()
    return run(a)


if __name__ == "__main__":
    sys.exit(main())
