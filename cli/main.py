"""The ``wafl`` command: ``run``, ``server``, ``client``, ``worker``, ``bench``, ``analyze``, ``health``."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from wafl.cli.cgroups import CpuQuotaUnavailable
from wafl.cli.enroll import add_enroll_parser
from wafl.cli.netns import LinkShapingUnavailable
from wafl.cli.tokens import add_token_args, read_token
from wafl.common.config import ConfigError, RunConfig, load_config
from wafl.common.contract import PROTOCOLS
from wafl.common.datasets.base import DatasetNotFoundError
from wafl.common.errors import UsageError
from wafl.server import strategies as _strategies  # noqa: F401  (the rules validate their configuration sections)


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    k, v = text.split("=", 1)
    try:
        value: Any = json.loads(v)
    except ValueError:
        value = v
    return k.strip(), value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 0..65535")
    return port


def _config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run configuration (defaults <- --config file <- these flags)")
    g.add_argument("--config", help="TOML or JSON file with configuration fields")
    g.add_argument("--dataset")
    g.add_argument("--data-dir", dest="data_dir", help="folder holding the larger datasets")
    g.add_argument("--partition", choices=["dirichlet", "dirichlet-equal", "iid"])
    g.add_argument("--alpha", type=float, help="per-class Dirichlet concentration")
    g.add_argument("--delta", type=float, help="class-prior concentration of dirichlet-equal")
    g.add_argument("--clients", dest="num_clients", type=int)
    g.add_argument("--rounds", type=int)
    g.add_argument("--fraction", type=float, help="share of clients selected per round")
    g.add_argument("--act-prob", dest="act_prob", type=float, help="independent per-client activation probability")
    g.add_argument("--algorithm", help="e.g. fedavg, scd, ditto, fedhkd, fedproto, fedprox+asd")
    g.add_argument("--protocol", choices=PROTOCOLS)
    g.add_argument("--aggregation", help="sync (lock-step rounds), buffered (FedBuff) or fedasync (FedAsync)")
    g.add_argument("--concurrency", type=int, help="buffered: clients training at once (default: all)")
    g.add_argument("--buffer-size", dest="buffer_size", type=int, help="buffered: updates per new version")
    g.add_argument("--slowdown", help="per-client compute slow-down: none, a list '1,2,4,...' or lognormal:sigma=S")
    g.add_argument("--dropout", type=float, help="probability that a client asked to train goes offline instead")
    g.add_argument("--tensorboard", help="write TensorBoard event files of the run into this folder")
    g.add_argument("--model")
    g.add_argument("--seed", type=int)
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--param",
        "-p",
        action="append",
        type=_kv,
        default=[],
        metavar="KEY=VALUE",
        help="algorithm parameter, repeatable",
    )
    g.add_argument(
        "--set",
        action="append",
        type=_kv,
        default=[],
        metavar="FIELD=VALUE",
        help="any configuration field, repeatable",
    )


def _resolve_config(a: argparse.Namespace) -> RunConfig:
    names = (
        "dataset",
        "data_dir",
        "partition",
        "alpha",
        "delta",
        "num_clients",
        "rounds",
        "fraction",
        "act_prob",
        "algorithm",
        "protocol",
        "aggregation",
        "concurrency",
        "buffer_size",
        "slowdown",
        "dropout",
        "tensorboard",
        "model",
        "seed",
        "device",
    )
    overrides: dict[str, Any] = {n: getattr(a, n) for n in names if getattr(a, n, None) is not None}
    overrides.update(dict(a.set))
    if a.param:
        overrides["params"] = dict(a.param)
    return load_config(a.config, overrides)


def _setup_logging(component: str, log_file: str | None, quiet: bool = False) -> None:
    from wafl.common.logs import configure_logging

    configure_logging(component, log_file, console=not quiet)


def cmd_run(a: argparse.Namespace) -> int:
    from wafl.cli.launcher import launch
    from wafl.client.trainer import resolve_device

    cfg = _resolve_config(a)
    if a.out and (Path(a.out) / "results.jsonl").exists():
        raise UsageError(f"--out {a.out} already holds a run (results.jsonl): choose another folder")
    if a.ray is not None:
        return _run_on_ray(a, cfg)
    device = resolve_device(cfg.device)  # every client runs here: a missing GPU is an error now, not at join
    _check_dataset(cfg)
    if a.out:
        _creatable(Path(a.out))
    _check_link_rate(a.link_rate, cfg)
    _check_host_cpus(a.host_cpus, cfg)
    workers = _workers(a.workers, cfg, bool(a.link_rate or (a.host_cpus or "none") != "none"))
    if a.slots is not None and (workers is None or a.slots < 1):
        raise ConfigError(f"--slots={a.slots} needs --workers (not off or 0) and must be at least 1")
    summary = launch(
        cfg,
        Path(a.out) if a.out else None,
        link_rate=a.link_rate,
        show_progress=not a.quiet,
        timeout_s=a.timeout,
        host_cpus=a.host_cpus,
        workers=workers,
        slots=a.slots,
        # this process is the command: the run's processes fork from it (wafl.cli.forking), except where they
        # use CUDA, which this process may have initialized by looking for it (CUDA does not survive a fork)
        fork=device.type == "cpu",
    )
    return 0 if summary.ok else 1


def _run_on_ray(a: argparse.Namespace, cfg: RunConfig) -> int:
    """``wafl run --ray [ADDRESS]``: the server and the workers as actors on a Ray cluster (the clients run
    on its nodes, so their device is not checked here)."""
    from wafl.cli.raylaunch import import_ray, launch_ray

    import_ray()  # one line when Ray is not installed, before anything else
    if a.link_rate or (a.host_cpus or "none") != "none":
        raise UsageError("--ray places workers on a cluster: it has no per-client links (--link-rate) or CPU shares")
    workers = None if a.workers in (None, "auto") else _workers(a.workers, cfg, False)
    if a.workers in OFF:
        raise UsageError(f"--ray runs the clients in worker actors: --workers {a.workers} is not available with it")
    _check_dataset(cfg)  # the server actor starts on this node when it has room
    if a.out:
        _creatable(Path(a.out))
    summary = launch_ray(
        cfg,
        Path(a.out) if a.out else None,
        address=a.ray or None,
        workers=workers,
        slots=a.slots,
        worker_cpus=a.ray_worker_cpus,
        worker_gpus=a.ray_worker_gpus,
        server_cpus=a.ray_server_cpus,
        max_restarts=a.ray_max_restarts,
        show_progress=not a.quiet,
        timeout_s=a.timeout,
    )
    return 0 if summary.ok else 1


OFF = ("off", "0")  # --workers off / 0: one process per client


def _workers(spec: str | None, cfg: RunConfig, per_client_hosts: bool) -> int | None:
    """``--workers``: a count, ``auto`` (one per core, at most one per client) or ``off``/``0`` (one process
    per client); unset: ``auto``, or ``off`` with per-client links or CPU shares (a namespace or a control
    group holds one process)."""
    from wafl.cli.launcher import check_workers, default_workers

    if spec is None:
        spec = "off" if per_client_hosts else "auto"
    if spec in OFF:
        return None
    if spec == "auto":
        return default_workers(cfg.num_clients)
    try:
        n = int(spec)
    except ValueError:
        raise UsageError(f"--workers={spec!r} is not a count, auto or off") from None
    return check_workers(n, cfg)


def _check_link_rate(spec: str | None, cfg: RunConfig) -> None:
    if spec:
        from wafl.common.heterogeneity import link_rates

        try:
            link_rates(spec, cfg.num_clients, cfg.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_host_cpus(spec: str | None, cfg: RunConfig) -> None:
    if spec:
        from wafl.cli.cgroups import machine_cpus
        from wafl.common.heterogeneity import host_cpus

        try:
            host_cpus(spec, cfg.num_clients, cfg.seed, machine_cpus())
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_dataset(cfg: RunConfig) -> None:
    """The run's dataset loads here (its files are present and readable) before any process starts."""
    from wafl.common.datasets import load_dataset

    data = load_dataset(cfg.dataset, cfg.data_dir)
    if cfg.client_size is not None and cfg.client_size * cfg.num_clients > len(data.train_labels):
        raise ConfigError(
            f"client_size={cfg.client_size} for {cfg.num_clients} clients needs {cfg.client_size * cfg.num_clients} "
            f"samples; {cfg.dataset}'s training split has {len(data.train_labels)}"
        )


def _creatable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} cannot be created: {e.strerror}") from None


def cmd_server(a: argparse.Namespace) -> int:
    from wafl.server.app import check_out_dir, serve

    cfg = _resolve_config(a)
    out = Path(a.out)
    check_out_dir(out, a.resume)
    _setup_logging("server", a.log_file or str(out / "logs" / "server.jsonl"), a.quiet)
    _threads(a.threads)
    from wafl.common.tls import server_tls
    from wafl.server.auth import load_enrollment

    tls = server_tls(a.tls_cert, a.tls_key, a.tls_client_ca)
    enrollment = load_enrollment(a.enrollment, cfg.num_clients) if a.enrollment else None
    return asyncio.run(
        serve(
            cfg,
            a.host,
            a.port,
            out,
            token=read_token(a),
            resume=a.resume,
            ready_file=Path(a.ready_file) if a.ready_file else None,
            tls=tls,
            enrollment=enrollment,
            allow_open=a.allow_open,
        )
    )


def _client_setup(a: argparse.Namespace, log_name: str) -> dict[str, Any]:
    """What `wafl client` and `wafl worker` share: TLS, logging and threads set up, and the keyword
    arguments of their clients' sessions (state folder, data, device, token, reconnect limit, TLS)."""
    from wafl.common.tls import client_tls

    tls = client_tls(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key)
    _setup_logging(log_name, a.log_file, a.quiet)
    _threads(a.threads)
    return {
        "state_dir": Path(a.state_dir) if a.state_dir else None,
        "data_dir": a.data_dir,
        "device": a.device,
        "token": read_token(a),
        "reconnect_s": a.reconnect_s,
        "tls": tls,
    }


def cmd_client(a: argparse.Namespace) -> int:
    from wafl.client.app import run_client

    return asyncio.run(run_client(a.server, a.index, **_client_setup(a, f"client-{a.index}")))


def cmd_worker(a: argparse.Namespace) -> int:
    from wafl.client.worker import format_indices, parse_indices, run_worker

    indices = parse_indices(a.clients)
    slots = a.slots if a.slots is not None else len(os.sched_getaffinity(0))
    if slots < 1:
        raise ConfigError(f"--slots={slots} must be at least 1")
    setup = _client_setup(a, f"worker-{format_indices(indices)}")
    return asyncio.run(run_worker(a.server, indices, slots, **setup))


def cmd_health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from wafl.common.tls import client_tls

    tls = client_tls(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key)
    try:
        ch = (
            grpc.insecure_channel(a.server)
            if tls is None
            else grpc.secure_channel(a.server, tls.credentials(), options=tls.options())
        )
        with ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout
            )
    except grpc.RpcError as e:
        print(f"{a.server}: {e.code().name} {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{a.server}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _bench_host_cpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-cpus",
        help="CPU share of every host, each process in its own control group (root): auto (the cores split "
        "evenly between the server and the clients; the default, with a warning and shared cores where control "
        "groups cannot be used), a share, one per client, lognormal:median=C,sigma=S, optionally with server=C; "
        "none: every process shares every core",
    )


def cmd_bench(a: argparse.Namespace) -> int:
    from wafl.cli.bench import bench_protocols

    cfg = _resolve_config(a)
    _check_link_rate(a.link_rate, cfg)
    _check_host_cpus(a.host_cpus, cfg)
    return bench_protocols(
        cfg,
        Path(a.out),
        link_rate=a.link_rate,
        target=a.target,
        show_progress=not a.quiet,
        host_cpus=a.host_cpus,
        same_rounds=a.same_rounds,
    )


ASYNC_DEFAULTS = {
    "algorithm": "ditto",
    "num_clients": 8,
    "slowdown": "lognormal:sigma=1",
    "rounds": 15,
    "buffer_size": 6,
}


def cmd_bench_async(a: argparse.Namespace) -> int:
    from wafl.cli.bench_async import bench_async

    for k, v in ASYNC_DEFAULTS.items():
        if getattr(a, k, None) is None and k not in dict(a.set):
            setattr(a, k, v)
    cfg = _resolve_config(a)
    _check_link_rate(a.link_rate, cfg)
    _check_host_cpus(a.host_cpus, cfg)
    if a.versions_factor < 1:
        raise ConfigError(f"--versions-factor={a.versions_factor} must be >= 1")
    return bench_async(
        cfg,
        Path(a.out),
        link_rate=a.link_rate,
        target=a.target,
        show_progress=not a.quiet,
        host_cpus=a.host_cpus,
        versions_factor=a.versions_factor,
    )


def cmd_sweep(a: argparse.Namespace) -> int:
    from wafl.cli.sweep import sweep

    if a.jobs < 1:
        raise ConfigError(f"--jobs={a.jobs} must be >= 1")
    out = Path(a.out) if a.out else None
    return sweep(Path(a.file), network=a.network, jobs=a.jobs, out=out, show_progress=not a.quiet)


def cmd_table(a: argparse.Namespace) -> int:
    from wafl.cli.table import TableError, main

    try:
        return main(a.dirs, a.by, a.target, a.baseline, a.json, a.metrics)
    except TableError as e:
        print(f"wafl: {e}", file=sys.stderr)
        return 2


def _threads(n: int | None) -> None:
    import torch

    torch.set_num_threads(n or 1)


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
    _config_args(r)
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
    _config_args(s)
    s.add_argument("--host", default=os.environ.get("WAFL_HOST", "0.0.0.0"))
    s.add_argument("--port", type=_port, default=os.environ.get("WAFL_PORT", "50051"), help="0: any free port")
    s.add_argument("--out", default=os.environ.get("WAFL_OUT", "runs/server"))
    add_token_args(s, "the shared secret clients must present (or WAFL_TOKEN)")
    s.add_argument(
        "--enrollment",
        default=os.environ.get("WAFL_ENROLLMENT"),
        help="file of 'INDEX SECRET' lines: each client joins with the secret of its own index (instead of --token)",
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
    bp = bsub.add_parser("protocols", help="wait-free vs compute-and-wait, same seeds, real wall-clock")
    _config_args(bp)
    bp.add_argument("--out", default="runs/bench-protocols")
    bp.add_argument(
        "--link-rate", help="shape every client's link to RATE (root only), e.g. 20mbit; the server's: their sum"
    )
    bp.add_argument("--target", type=float, default=0.9, help="PM accuracy for zeta_total_s")
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
    _config_args(ba)
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
    sw.add_argument("--out", help="output folder (default: the file's `out`, else runs/sweep-<name>)")
    sw.add_argument("--quiet", action="store_true")
    sw.set_defaults(fn=cmd_sweep)

    tb = sub.add_parser("table", help="mean/std/min-max table over seeds from run or sweep folders")
    tb.add_argument("dirs", nargs="+", help="run folders or folders holding them")
    tb.add_argument("--by", help="fields that make the rows (default: algorithm,params)")
    tb.add_argument("--baseline", help="row label to pair every other row with, seed by seed")
    tb.add_argument("--target", type=float, default=0.9, help="GM accuracy for the time-to-target column")
    tb.add_argument("--json", help="also write the table as JSON here")
    tb.add_argument(
        "--metrics",
        help="columns shown, comma-separated (default: all with values): final_gm, best_gm, final_pm, best_pm, "
        "final_local, best_local, time_to_target, mbytes, epsilon",
    )
    tb.set_defaults(fn=cmd_table)

    from wafl.cli.analyze import add_parser as add_analyze

    add_analyze(sub, POSITIVE_INT, POSITIVE_SECONDS)
    add_enroll_parser(sub)
    h = sub.add_parser("health", help="gRPC health check of a server (exit 0 when SERVING)")
    h.add_argument("--server", default=os.environ.get("WAFL_SERVER", "localhost:50051"))
    h.add_argument("--service", default="")
    h.add_argument("--timeout", type=POSITIVE_SECONDS, default=3.0)
    _tls_client_args(h)
    h.set_defaults(fn=cmd_health)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        print(f"wafl: configuration error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"wafl: {e}", file=sys.stderr)
        return 2
    except DatasetNotFoundError as e:  # names the dataset, the folder searched and how to get the files
        print(f"wafl: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # a client that gave up on the server (--reconnect-s)
        print(f"wafl: {e}", file=sys.stderr)
        return 1
    except (LinkShapingUnavailable, CpuQuotaUnavailable) as e:
        print(f"wafl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
