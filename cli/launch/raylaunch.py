"""``wafl run --ray``: the server and the workers of a run as Ray actors on a Ray cluster.

Ray places and supervises; the federation's traffic is wafl's gRPC protocol, as with ``wafl run``.
The server actor runs :func:`wafl.server.app.serve` (what ``wafl server`` runs) on a node-local folder,
listening on its node's address (``ray.util.get_node_ip_address()``: 127.0.0.1 on a cluster that
``--ray`` starts on this machine alone) with a fresh run token; by default it is placed on the driver's
node (softly: elsewhere when that node has no room). Each worker actor runs
:func:`wafl.client.worker.run_worker` (what ``wafl worker`` runs) for a group of clients (balanced by
training samples, as ``wafl run`` groups them), with ``worker_cpus`` CPUs and ``worker_gpus`` GPUs
(fractions allowed: Ray then shares a GPU between workers) reserved for it, spread over the nodes. A
worker actor whose process dies is restarted by Ray (up to ``max_restarts`` times, possibly on another
node); its clients re-join with the session credentials and models kept in the worker's state folder on
its node, as a restarted ``wafl worker`` does. A server actor whose process dies is restarted as well
and resumes the run from its checkpoint on the same port (:class:`ServerActor`). When the server ends,
the driver copies the server's run folder (results, reports, timelines, configuration, checkpoint,
server log) and every worker's log into the output folder, writes ``ray.json`` (where each actor ran,
restarts) and the usual ``summary.json`` and ``accuracy.png``.

Ray is optional (``pip install 'wafl[ray]'``): it is imported only here, when ``--ray`` is used.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wafl.cli.launch.launcher import (
    Progress,
    RunSummary,
    _read_rows,
    check_workers,
    client_sizes,
    default_out,
    finish_run,
    split_clients,
)
from wafl.common.config import RunConfig
from wafl.common.errors import RunAborted, UsageError
from wafl.common.plateau import ran_to_end

LOOPBACK = "127.0.0.1"
NO_RAY = "--ray needs Ray, an optional extra of wafl: pip install 'wafl[ray]'"


# Ray's switch between a cluster of machines and one machine alone (named for the platforms where the second
# is its default). Off, every Ray process on this machine (GCS, raylets, workers, this driver) binds and
# advertises 127.0.0.1 only, and ``ray.init("127.0.0.1:PORT")`` connects there instead of to the machine's
# outward address. The processes a cluster starts inherit it from the environment.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(loopback: bool = False) -> Any:
    """The ``ray`` module, or a :class:`UsageError` (one line) when it is not installed. With ``loopback``,
    a cluster started from here, and every node added to it on this machine, listens on loopback only
    (see :data:`LOCAL_ONLY_ENV`)."""
    if loopback:
        os.environ[LOCAL_ONLY_ENV] = "0"
    try:
        import ray
        import ray._private.ray_constants as ray_constants
    except ImportError:
        raise UsageError(NO_RAY) from None
    if loopback:  # read once, when Ray was first imported: set here too if that was before
        ray_constants.ENABLE_RAY_CLUSTER = False
    return ray


def _ray_initialized() -> bool:
    """Whether this process is connected to a Ray cluster already (without importing Ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _node() -> dict[str, Any]:
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


def _folder_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class ServerActor:
    """The run's server in a Ray actor: ``start`` returns where it listens, ``poll`` its exit code (None while
    running) and the results so far, ``files`` the run folder it wrote.

    The run folder is node-local and named after the run, the same for every incarnation of the actor. An
    incarnation that finds the address an earlier one listened on (its ``server.json``) is a restart by Ray
    after the earlier process died: it listens on the same port, so the workers' clients reconnect to the
    address they were given, and resumes the run from its last checkpoint (``wafl server --resume``)."""

    def __init__(self, cfg_json: str, token: str, run: str) -> None:
        self.cfg = RunConfig.from_json(cfg_json).validate()
        self.token = token
        self.out = Path(tempfile.gettempdir()) / "wafl-ray" / run / "server"
        self.code: int | None = None
        self.error = ""
        self.thread: threading.Thread | None = None
        self.info: dict[str, Any] | None = None

    def start(self, timeout_s: float = 120.0) -> dict[str, Any]:
        import ray
        import torch
        from wafl.common.logs import configure_logging

        if self.info is not None:  # this incarnation listens already (a repeated call)
            return self.info
        ready = self.out / "server.json"
        resume = ready.exists()
        if not resume and ray.get_runtime_context().was_current_actor_reconstructed:
            raise RuntimeError(
                f"the server actor was restarted on a node without its run folder ({self.out}): "
                "the run cannot be resumed there"
            )
        port = int(json.loads(ready.read_text())["port"]) if resume else 0
        ready.unlink(missing_ok=True)  # written again once this incarnation listens
        self.out.mkdir(parents=True, exist_ok=True)
        configure_logging("server", self.out / "logs" / "server.jsonl", console=False)
        torch.set_num_threads(1)
        where = _node()
        self.thread = threading.Thread(
            target=self._serve, args=(where["ip"], port, resume, ready), name="wafl-server", daemon=True
        )
        self.thread.start()
        t0 = time.monotonic()
        while not ready.exists():
            if self.code is not None:
                raise RuntimeError(f"the server exited with code {self.code} before listening: {self.error}")
            if time.monotonic() - t0 > timeout_s:
                raise RunAborted(f"the server did not start listening within {timeout_s:g} s")
            time.sleep(0.05)
        self.info = {
            **where,
            "host": where["ip"],
            "port": int(json.loads(ready.read_text())["port"]),
            "resumed": resume,
        }
        return self.info

    def _serve(self, host: str, port: int, resume: bool, ready: Path) -> None:
        from wafl.server.app import serve

        try:
            self.code = asyncio.run(
                serve(self.cfg, host, port, self.out, token=self.token, resume=resume, ready_file=ready)
            )
        # BaseException: the server thread ends with a code whatever stopped it (SystemExit included), else
        # the driver, which polls for that code, would wait for ever; reported through poll()
        except BaseException as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            self.code = 1

    def poll(self) -> tuple[int | None, list[dict[str, Any]], str]:
        return self.code, _read_rows(self.out / "results.jsonl"), self.error

    def joined(self) -> int:
        """Clients that have joined so far (from the server's log; it reads the whole log)."""
        log = self.out / "logs" / "server.jsonl"
        clients = set()
        for line in log.read_text().splitlines() if log.exists() else []:
            if '"client.join"' in line:
                try:
                    clients.add(json.loads(line).get("client"))
                except ValueError:
                    pass  # a line being written
        return len(clients)

    def files(self) -> dict[str, bytes]:
        return _folder_files(self.out)

    def clean(self) -> None:
        shutil.rmtree(self.out, ignore_errors=True)
        try:
            self.out.parent.rmdir()  # the run's folder on this node, once the workers' are gone too
        except OSError:
            pass


class WorkerActor:
    """One ``wafl worker`` in a Ray actor. Its state folder and log live in a node-local folder named after
    the run and the worker, the same after a restart on the same node."""

    def __init__(
        self, run: str, w: int, address: str, indices: list[int], slots: int, token: str, data_dir: str | None
    ) -> None:
        self.folder = Path(tempfile.gettempdir()) / "wafl-ray" / run / f"worker-{w}"
        self.w, self.address, self.indices, self.slots = w, address, indices, slots
        self.token, self.data_dir = token, data_dir

    def where(self) -> dict[str, Any]:
        import ray

        return {**_node(), "restarted": ray.get_runtime_context().was_current_actor_reconstructed}

    def credentials(self) -> dict[str, str]:
        """The session credentials its clients keep in the state folder (the driver holds a copy for a restart
        on another node)."""
        return {p.name: p.read_text() for p in (self.folder / "clients").glob("client-*.credential")}

    def run(self, credentials: dict[str, str] | None = None) -> dict[str, Any]:
        import torch
        from wafl.client.worker import format_indices, run_worker
        from wafl.common.logs import configure_logging

        for name, text in (credentials or {}).items():  # a restart on a node without the state folder
            path = self.folder / "clients" / Path(name).name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                path.chmod(0o600)
        log = self.folder / f"worker-{self.w}.jsonl"
        configure_logging(f"worker-{format_indices(self.indices)}", log, console=False)
        torch.set_num_threads(1)
        try:
            code = asyncio.run(
                run_worker(
                    self.address,
                    self.indices,
                    self.slots,
                    state_dir=self.folder / "clients",
                    data_dir=self.data_dir,
                    token=self.token,
                )
            )
            error = ""
        except Exception as e:  # noqa: BLE001 - the driver reports it; a crash of the process is a restart instead
            code, error = 1, f"{type(e).__name__}: {e}"
        return {**self.where(), "code": code, "error": error, "log": log.read_bytes() if log.exists() else b""}

    def clean(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.folder.parent.rmdir()  # the run's folder on this node, once its last worker is gone
        except OSError:
            pass


def _actor_state(ray: Any, handle: Any) -> str:
    """ALIVE, RESTARTING, DEAD, ... as Ray's actor table has it ("" when it cannot be read)."""
    try:
        from ray._private.state import actors

        return str(actors(handle._actor_id.hex()).get("State", ""))
    except Exception:  # noqa: BLE001 - a private interface: without it, the failures are counted instead
        return ""


def _restarted_server(
    ray: Any, server: Any, max_restarts: int, actor_error: type[BaseException], timeout_s: float = 300.0
) -> Any:
    """Waits for Ray's restart of the server actor and starts its new incarnation (which resumes the run
    on the same port); raises RuntimeError when the actor is dead for good or does not come back."""
    give_up = time.monotonic() + timeout_s
    while True:
        if _actor_state(ray, server) == "DEAD":
            raise RuntimeError(f"the server actor died (max_restarts={max_restarts})")
        try:
            return ray.get(server.start.remote())
        except actor_error:
            if time.monotonic() > give_up:
                raise RuntimeError(f"the server actor did not come back within {timeout_s:g} s") from None
            time.sleep(0.5)


def ray_workers(ray: Any, num_clients: int, worker_cpus: float, worker_gpus: float, server_cpus: float) -> int:
    """``--workers auto`` on a cluster: as many workers as its CPUs (and GPUs) hold beside the server,
    at least one and at most one per client."""
    total = ray.cluster_resources()
    n = int(max(0.0, total.get("CPU", 0.0) - server_cpus) // worker_cpus) if worker_cpus > 0 else num_clients
    if worker_gpus > 0:
        n = min(n, int(total.get("GPU", 0.0) // worker_gpus))
    return max(1, min(num_clients, n))


def warn_unplaceable(
    total: dict[str, float], workers: int, worker_cpus: float, worker_gpus: float, server_cpus: float
) -> str:
    """The warning (on stderr, and returned; "" when none) for ``--workers`` that the cluster's resources
    cannot all hold at once: the actors beyond wait for resources (an autoscaling cluster may add them),
    and their clients' joins may run out ``join_timeout_s``."""
    need = {"CPU": server_cpus + workers * worker_cpus, "GPU": workers * worker_gpus}
    short = [f"{need[k]:g} {k}s, it has {total.get(k, 0.0):g}" for k in need if need[k] > total.get(k, 0.0) + 1e-9]
    if not short:
        return ""
    text = (
        f"wafl: --workers {workers} needs {'; '.join(short)} (the server's and every worker's reservation): "
        "the workers beyond wait until the cluster has room, and the run may end at join_timeout_s"
    )
    print(text, file=sys.stderr)
    return text


def launch_ray(
    cfg: RunConfig,
    out_dir: Path | None = None,
    address: str | None = None,
    workers: int | None = None,
    slots: int | None = None,
    worker_cpus: float = 1.0,
    worker_gpus: float = 0.0,
    server_cpus: float = 1.0,
    max_restarts: int = 3,
    show_progress: bool = True,
    timeout_s: float | None = None,
) -> RunSummary:
    """Runs the federation ``cfg`` on the Ray cluster at ``address`` (as :func:`ray.init` takes it: None
    starts or finds one as Ray does by default, ``auto`` an existing one on this machine, ``HOST:PORT``
    one elsewhere; a driver already connected keeps its connection) and gathers its output folder here.

    ``workers``: worker actors (None: as many as the cluster's resources hold, see :func:`ray_workers`),
    each running ``slots`` trainings at once (default: its whole CPUs, at least one). The actors are
    named ``server`` and ``worker-<w>`` in the Ray namespace ``wafl-<output folder name>``.
    """
    from wafl.server.app import check_networked

    check_networked(cfg)  # before any process starts
    # a cluster started here, on this machine alone, listens on loopback only
    local = address is None and not os.environ.get("RAY_ADDRESS")
    ray = import_ray(loopback=local and not _ray_initialized())
    from ray.exceptions import RayActorError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if worker_cpus < 0 or worker_gpus < 0 or server_cpus < 0:
        raise UsageError("--ray-worker-cpus, --ray-worker-gpus and --ray-server-cpus must not be negative")
    out = out_dir or default_out(cfg)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            node = {"_node_ip_address": LOOPBACK} if local else {}
            ray.init(address=address, logging_level="WARNING", log_to_driver=False, configure_logging=False, **node)
        except ConnectionError as e:
            raise UsageError(f"--ray {address or ''}: no Ray cluster to connect to ({e})".replace("  ", " ")) from None
    namespace = f"wafl-{out.name}"
    run = f"{out.name}-{secrets.token_hex(4)}"
    token = secrets.token_urlsafe(24)
    n_workers = workers or ray_workers(ray, cfg.federation.num_clients, worker_cpus, worker_gpus, server_cpus)
    check_workers(n_workers, cfg)
    if workers:
        warn_unplaceable(ray.cluster_resources(), n_workers, worker_cpus, worker_gpus, server_cpus)
    per_worker = slots or max(1, int(worker_cpus))
    summary = RunSummary(out, ok=False)
    t0 = time.monotonic()
    server: Any = None
    handles: list[Any] = []
    record: dict[str, Any] = {"address": address, "namespace": namespace, "workers": []}
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        server = (
            ray.remote(ServerActor)
            .options(
                name="server",
                namespace=namespace,
                num_cpus=server_cpus,
                max_restarts=max_restarts,
                scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node, soft=True),
            )
            .remote(cfg.to_json(), token, run)
        )
        info = ray.get(server.start.remote())
        record["server"] = {**info, "pids": [info["pid"]], "restarts": 0}
        listen = f"{info['host']}:{info['port']}"
        from wafl.client.worker import format_indices

        Worker = ray.remote(WorkerActor)
        pending: dict[Any, tuple[str, int]] = {}
        by_samples = split_clients(cfg.federation.num_clients, n_workers, client_sizes(cfg))
        for w, indices in enumerate(by_samples):
            h = Worker.options(
                name=f"worker-{w}",
                namespace=namespace,
                num_cpus=worker_cpus,
                num_gpus=worker_gpus,
                max_restarts=max_restarts,
                max_concurrency=2,  # credentials() while run() runs
                scheduling_strategy="SPREAD",
            ).remote(run, w, listen, indices, per_worker, token, cfg.data.data_dir)
            handles.append(h)
            record["workers"].append(
                {"clients": format_indices(indices), "nodes": [], "ips": [], "pids": [], "restarts": 0, "code": None}
            )
            pending[h.where.remote()] = ("where", w)
            pending[h.run.remote()] = ("run", w)
        progress = Progress(cfg.federation.rounds, enabled=show_progress)
        deadline = t0 + timeout_s if timeout_s else float("inf")
        code: int | None = None
        error = ""
        server_end: float | None = None
        kept: dict[int, dict[str, str]] = {}  # worker -> its clients' session credentials
        asked: set[int] = set()
        next_ask = time.monotonic() + 2.0
        failures = [0] * len(handles)  # calls of run() lost with the actor's process
        retry_at: dict[int, float] = {}
        while True:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0.5) if pending else ([], [])
            for ref in done:
                kind, w = pending.pop(ref)
                rec = record["workers"][w]
                try:
                    result = ray.get(ref)
                except RayActorError:
                    if kind == "run":
                        failures[w] += 1
                        if _actor_state(ray, handles[w]) == "DEAD" or failures[w] > 30 * (max_restarts + 1):
                            rec["code"], rec["error"] = 1, f"the worker actor died (max_restarts={max_restarts})"
                        else:  # Ray restarts the actor (or is restarting it): run it again once it is back
                            retry_at[w] = time.monotonic() + 1.0
                    elif kind == "credentials":
                        asked.discard(w)
                    continue
                except Exception as e:  # noqa: BLE001 - an error inside the actor's code: no restart
                    rec["code"], rec["error"] = 1, f"{type(e).__name__}: {e}"
                    continue
                if kind == "where":
                    rec["nodes"].append(result["node_id"])
                    rec["ips"].append(result["ip"])
                    rec["pids"].append(result["pid"])
                    rec["restarts"] = len(set(rec["pids"])) - 1  # each incarnation is a new process
                elif kind == "credentials":
                    asked.discard(w)
                    kept[w] = {**kept.get(w, {}), **result}
                else:
                    rec["code"], rec["error"] = result["code"], result["error"]
                    (out / "logs" / f"worker-{w}.jsonl").write_bytes(result["log"])
            for w, at in list(retry_at.items()):  # its clients re-join from their state folder
                if time.monotonic() >= at:
                    del retry_at[w]
                    pending[handles[w].where.remote()] = ("where", w)
                    pending[handles[w].run.remote(kept.get(w))] = ("run", w)
            if time.monotonic() > next_ask:  # copies of the clients' credentials, for a restart on another node
                next_ask = time.monotonic() + 2.0
                for w, h in enumerate(handles):
                    if w not in asked and record["workers"][w]["code"] is None:
                        asked.add(w)
                        pending[h.credentials.remote()] = ("credentials", w)
            try:
                code, rows, error = ray.get(server.poll.remote())
            except RayActorError:  # the server's process died: Ray restarts it, and it resumes the run
                info = _restarted_server(ray, server, max_restarts, RayActorError)
                record["server"]["pids"].append(info["pid"])
                record["server"]["restarts"] += 1
                continue
            progress.update(rows, time.monotonic() - t0)
            if code is not None:
                server_end = server_end or time.monotonic()
                if not (pending or retry_at) or time.monotonic() > server_end + 30:  # the workers' reports, logs
                    break
            if time.monotonic() > deadline:
                raise RunAborted(f"the run exceeded --timeout {timeout_s:g} s and was stopped")
            if code is None and all(r["code"] not in (None, 0) for r in record["workers"]):
                raise RuntimeError(f"every worker failed: {[r.get('error') for r in record['workers']]}")
        summary.rows = rows
        progress.update(rows, time.monotonic() - t0)
        progress.close()
        for name, data in ray.get(server.files.remote()).items():
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        (out / "server.json").unlink(missing_ok=True)  # the ready file: an address on another node
        summary.server_code = code
        summary.client_codes = [r["code"] for r in record["workers"]]
        summary.ok = code == 0 and ran_to_end(rows, cfg.federation.rounds)  # or flattened (plateau_window)
        if error:
            record["server_error"] = error
    finally:
        for h in handles:
            try:
                ray.get(h.clean.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a worker that cannot be reached keeps its node-local folder
                pass
            ray.kill(h, no_restart=True)
        if server is not None:
            try:
                ray.get(server.clean.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
            ray.kill(server, no_restart=True)
        if connected_here:
            ray.shutdown()
    summary.wall_s = time.monotonic() - t0
    record["wall_s"] = round(summary.wall_s, 3)
    (out / "ray.json").write_text(json.dumps(record, indent=2) + "\n")
    return finish_run(summary, cfg, out, show_progress)
