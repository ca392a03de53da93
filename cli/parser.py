"""The ``wafl`` command line: the argparse tree of every sub-command, its flags, help texts and defaults;
each sub-command's ``fn`` is its body in :mod:`wafl.cli.commands`."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from wafl.cli.commands.analyze import add_analyze_parser
from wafl.cli.commands.bench import ASYNC_DEFAULTS, cmd_bench, cmd_bench_async
from wafl.cli.commands.clients import cmd_client, cmd_worker
from wafl.cli.commands.enroll import add_enroll_parser
from wafl.cli.commands.health import cmd_health
from wafl.cli.commands.results import cmd_sweep, cmd_table
from wafl.cli.commands.run import cmd_run
from wafl.cli.commands.serve import cmd_server
from wafl.cli.config_flags import add_config_args
from wafl.cli.tokens import add_token_args


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535")
    return port


def _bench_host_cpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-cpus",
        help="CPU share of every host, each process in its own control group (root): auto (the cores split "
        "evenly between the server and the clients; the default, with a warning and shared cores where control "
        "groups cannot be used), a share, one per client, lognormal:median=C,sigma=S, optionally with server=C; "
        "none: every process shares every core",
    )


class OneLineErrors(argparse.ArgumentParser):
    """Command-line mistakes are one line (``wafl run: error: ...``) and exit 2; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bounded(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
    """An argparse type: ``kind`` values above (``strict``) or at least ``low``; a one-line error otherwise."""
    word = f"{'>' if strict else '>='} {low:g}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{text!r} must be {word}")
        return value

    return parse


POSITIVE_INT = _bounded(int, 1, strict=False)
INDEX = _bounded(int, 0, strict=False)
POSITIVE_SECONDS = _bounded(float, 0, strict=True)
SECONDS = _bounded(float, 0, strict=False)


def _tls_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("WAFL_TLS_CA"),
        help="PEM CA bundle: connect over TLS and verify the server against it",
    )
    p.add_argument(
        "--tls-server-name",
        default=os.environ.get("WAFL_TLS_SERVER_NAME"),
        help="name the server's certificate must carry, when not the dialled host",
    )
    p.add_argument(
        "--tls-cert",
        default=os.environ.get("WAFL_TLS_CERT"),
        help="PEM certificate chain of this client, for a server that requires one (--tls-client-ca; with --tls-key)",
    )
    p.add_argument("--tls-key", default=os.environ.get("WAFL_TLS_KEY"), help="PEM private key of --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="wafl", description="Wait-free federated learning over gRPC.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="a whole federation on this machine: a server and N client processes")
    add_config_args(r)
    r.add_argument("--out", help="output folder (default runs/<time>-<algorithm>)")
    r.add_argument(
        "--link-rate",
        help="run each process in its own network namespace with links shaped to RATE (root only): one rate "
        "(20mbit), one per client (10mbit,20mbit,...) or lognormal:median=20mbit,sigma=S; the server's link "
        "carries the sum of the clients' rates",
    )
    r.add_argument(
        "--host-cpus",
        help="run each process in its own control group held to a CPU share (root): auto (the cores split evenly "
        "between the server and the clients), one share (0.4), one per client (0.2,0.4,...) or "
        "lognormal:median=C,sigma=S, optionally with server=C; none: every core shared "
        "(default: auto with --link-rate where control groups can be used, else none)",
    )
    r.add_argument(
        "--workers",
        help="host the clients in W worker processes (wafl worker): a count, auto (one per core, at most one per "
        "client) or off or 0 (one process per client, what the wall-clock protocol comparisons use); default: auto, "
        "off with --link-rate or --host-cpus (one namespace or control group per client)",
    )
    r.add_argument("--slots", type=POSITIVE_INT, help="trainings at once per worker (default: the cores shared out)")
    g = r.add_argument_group("Ray (pip install 'wafl[ray]')")
    g.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the server and the workers as Ray actors on a Ray cluster: ADDRESS as ray.init takes it (auto: "
        "the cluster this machine belongs to, HOST:PORT: another); without it Ray's default (RAY_ADDRESS, else a "
        "local one); the output folder is gathered here",
    )
    g.add_argument(
        "--ray-worker-cpus", type=_bounded(float, 0, strict=True), default=1.0, help="CPUs per worker (default 1)"
    )
    g.add_argument(
        "--ray-worker-gpus",
        type=_bounded(float, 0, strict=False),
        default=0.0,
        help="GPUs per worker, fractions allowed (0.25: four workers share a GPU; default 0)",
    )
    g.add_argument(
        "--ray-server-cpus", type=_bounded(float, 0, strict=False), default=1.0, help="CPUs of the server (default 1)"
    )
    g.add_argument(
        "--ray-max-restarts",
        type=_bounded(int, 0, strict=False),
        default=3,
        help="times a dead worker or server actor is restarted (clients re-join, the server resumes; default 3)",
    )
    r.add_argument(
        "--timeout", type=POSITIVE_SECONDS, default=None, help="seconds before the run is stopped (default: no limit)"
    )
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("server", help="the aggregation server of one run")
    add_config_args(s)
    s.add_argument("--host", default=os.environ.get("WAFL_HOST", "0.0.0.0"))
    s.add_argument("--port", type=_port, default=os.environ.get("WAFL_PORT", "50051"), help="0: any free port")
    s.add_argument("--out", default=os.environ.get("WAFL_OUT", "runs/server"))
    add_token_args(s, "the shared secret clients must present (or WAFL_TOKEN)")
    s.add_argument(
        "--enrollment",
        default=os.environ.get("WAFL_ENROLLMENT"),
        help="file of 'INDEX sha256:SALT:DIGEST' lines made by 'wafl enroll' (salted hashes, never the secrets): "
        "each client joins with the secret of its own index (instead of --token)",
    )
    s.add_argument(
        "--allow-open",
        action="store_true",
        help="serve a non-loopback --host without --token or --enrollment (anyone who reaches it may join)",
    )
    s.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    s.add_argument("--ready-file", help="write the bound port here once listening")
    s.add_argument("--log-file")
    s.add_argument("--threads", type=POSITIVE_INT, default=None)
    s.add_argument(
        "--tls-cert",
        default=os.environ.get("WAFL_TLS_CERT"),
        help="PEM certificate chain: serve over TLS (with --tls-key)",
    )
    s.add_argument("--tls-key", default=os.environ.get("WAFL_TLS_KEY"), help="PEM private key of --tls-cert")
    s.add_argument(
        "--tls-client-ca",
        default=os.environ.get("WAFL_TLS_CLIENT_CA"),
        help="PEM CA bundle: mutual TLS, every client presents a certificate issued by it whose common name "
        "ends in client-<INDEX>, and may act only as that index",
    )
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(fn=cmd_server)

    c = sub.add_parser("client", help="one client of a run")
    c.add_argument("--server", default=os.environ.get("WAFL_SERVER", "localhost:50051"), help="HOST:PORT")
    c.add_argument(
        "--index",
        type=INDEX,
        default=int(os.environ["WAFL_CLIENT_INDEX"]) if os.environ.get("WAFL_CLIENT_INDEX", "").isdigit() else None,
        required=not os.environ.get("WAFL_CLIENT_INDEX", "").isdigit(),
    )
    c.add_argument(
        "--state-dir",
        default=os.environ.get("WAFL_STATE_DIR"),
        help="keeps the personalized model and client state across restarts",
    )
    c.add_argument("--data-dir", default=os.environ.get("WAFL_DATA_DIR"))
    c.add_argument("--device", default=os.environ.get("WAFL_DEVICE"))
    add_token_args(c, "the run token or this client's enrollment secret (or WAFL_TOKEN)")
    c.add_argument("--reconnect-s", type=SECONDS, default=120.0, help="give up after this long without the server")
    c.add_argument("--log-file")
    c.add_argument("--threads", type=POSITIVE_INT, default=None)
    _tls_client_args(c)
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_client)

    w = sub.add_parser("worker", help="many clients of a run in one process, sharing a bounded number of trainings")
    w.add_argument("--server", default=os.environ.get("WAFL_SERVER", "localhost:50051"), help="HOST:PORT")
    w.add_argument(
        "--clients",
        default=os.environ.get("WAFL_CLIENT_INDICES"),
        required=not os.environ.get("WAFL_CLIENT_INDICES"),
        help="the client indices it hosts: 0-49, or a list like 0-9,20,30-39 (or WAFL_CLIENT_INDICES)",
    )
    w.add_argument(
        "--slots",
        type=int,
        default=None,
        help="trainings at once (default: the cores this process may use); GM work before wait-free PM work",
    )
    w.add_argument("--state-dir", default=os.environ.get("WAFL_STATE_DIR"), help="as wafl client, one file per client")
    w.add_argument("--data-dir", default=os.environ.get("WAFL_DATA_DIR"))
    w.add_argument("--device", default=os.environ.get("WAFL_DEVICE"))
    add_token_args(w, "the run token (or WAFL_TOKEN)")
    w.add_argument("--reconnect-s", type=SECONDS, default=120.0, help="give up after this long without the server")
    w.add_argument("--log-file")
    w.add_argument("--threads", type=POSITIVE_INT, default=None, help="torch threads per training (default 1)")
    _tls_client_args(w)
    w.add_argument("--quiet", action="store_true")
    w.set_defaults(fn=cmd_worker)

    b = sub.add_parser("bench", help="measurements")
    bsub = b.add_subparsers(dest="bench", required=True)
    bp = bsub.add_parser("protocols", help="wait-free vs compute-and-wait (vs adaptive), same seeds, real wall-clock")
    add_config_args(bp)
    bp.add_argument("--out", default="runs/bench-protocols")
    bp.add_argument(
        "--link-rate", help="shape every client's link to RATE (root only), e.g. 20mbit; the server's: their sum"
    )
    bp.add_argument("--target", type=float, default=0.9, help="PM accuracy for zeta_total_s")
    bp.add_argument(
        "--protocols",
        default="compute-and-wait,wait-free",
        help="comma-separated client protocols to run (compute-and-wait first whatever the order): "
        "compute-and-wait, wait-free, adaptive",
    )
    bp.add_argument(
        "--same-rounds",
        action="store_true",
        help="run wait-free for --rounds too (default: the rounds that fit in compute-and-wait's time at the "
        "ideal speedup, so that the shorter run does not cut off its time to the target)",
    )
    _bench_host_cpus_arg(bp)
    bp.add_argument("--quiet", action="store_true")
    bp.set_defaults(fn=cmd_bench)
    ba = bsub.add_parser(
        "async",
        help="sync vs buffered aggregation with heterogeneous clients, each under wait-free and compute-and-wait",
    )
    add_config_args(ba)
    ba.add_argument("--out", default="runs/bench-async")
    ba.add_argument("--link-rate", help="shape links (root only): a rate, a list or lognormal:median=RATE,sigma=S")
    ba.add_argument("--target", type=float, default=0.9, help="GM accuracy whose time to reach is compared")
    _bench_host_cpus_arg(ba)
    ba.add_argument(
        "--versions-factor",
        type=int,
        default=5,
        help="buffered runs publish this many times the versions that hold sync's client updates (default 5)",
    )
    ba.add_argument("--quiet", action="store_true")
    ba.set_defaults(
        fn=cmd_bench_async,
        **{k: None for k in ASYNC_DEFAULTS},
    )

    sw = sub.add_parser("sweep", help="one federation per point of a grid in a TOML file; resumable")
    sw.add_argument("file", help="the sweep file ([base], [grid], [[points]], out)")
    sw.add_argument("--network", action="store_true", help="run each point as server and client processes")
    sw.add_argument("--jobs", type=int, default=1, help="points run at once")
    sw.add_argument(
        "--slot-processes",
        type=int,
        default=0,
        help="in process: each compute-and-wait point trains its clients in this many forked processes "
        "(the same models as in threads; faster where Python's GIL is the limit); default 0: threads",
    )
    sw.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="rounds between two snapshots of an in-process point, from which it resumes after an interruption "
        "(default 0: as often as keeps their cost under 2%% of the point's time)",
    )
    sw.add_argument("--out", help="output folder (default: the file's `out`, else runs/sweep-<name>)")
    sw.add_argument(
        "--first",
        action="append",
        default=[],
        metavar="GLOB",
        help="run the points whose names match this pattern before the others (repeatable), e.g. '*,num_clients=10,*'",
    )
    sw.add_argument("--quiet", action="store_true")
    sw.set_defaults(fn=cmd_sweep)

    tb = sub.add_parser("table", help="mean/std/min-max table over seeds from run or sweep folders")
    tb.add_argument("dirs", nargs="+", help="run folders or folders holding them")
    tb.add_argument("--by", help="fields that make the rows (default: algorithm,params)")
    tb.add_argument("--baseline", help="row label to pair every other row with, seed by seed")
    tb.add_argument(
        "--within",
        help="fields of --by (comma-separated, e.g. num_clients): pair each row with the baseline's row at its own "
        "values of them; --baseline then names the baseline without them",
    )
    tb.add_argument("--target", type=float, default=0.9, help="GM accuracy for the time-to-target column")
    tb.add_argument("--json", help="also write the table as JSON here")
    tb.add_argument(
        "--metrics",
        help="columns shown, comma-separated (default: all with values): final_gm, best_gm, mean_last_gm, final_pm, "
        "best_pm, mean_last_pm, final_local, best_local, mean_last_local, time_to_target, mbytes, epsilon "
        "(mean_last_*: the mean over the last 10 evaluated rounds)",
    )
    tb.set_defaults(fn=cmd_table)

    add_analyze_parser(sub, POSITIVE_INT, POSITIVE_SECONDS)
    add_enroll_parser(sub)
    h = sub.add_parser("health", help="gRPC health check of a server (exit 0 when SERVING)")
    h.add_argument("--server", default=os.environ.get("WAFL_SERVER", "localhost:50051"))
    h.add_argument("--service", default="")
    h.add_argument("--timeout", type=POSITIVE_SECONDS, default=3.0)
    _tls_client_args(h)
    h.set_defaults(fn=cmd_health)
    return p
