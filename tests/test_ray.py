"""``wafl run --ray``: a federation whose server and workers are Ray actors on a local two-node Ray
cluster (Ray's own ``ray.cluster_utils.Cluster``: two raylets on this machine), one worker per
node, a worker actor killed mid-run and restarted by Ray, and the output folder gathered here."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from wafl.cli.main import main
from wafl.client.worker import parse_indices


def test_ray_without_ray_installed_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["run", "--ray", "--rounds", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == "wafl: --ray needs Ray, an optional extra of wafl: pip install 'wafl[ray]'\n"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--ray-worker-gpus", "-0.5"], "'-0.5' must be >= 0"),
        (["--ray-worker-cpus", "0"], "'0' must be > 0"),
        (["--ray-max-restarts", "-1"], "'-1' must be >= 0"),
    ],
)
def test_ray_resources_are_range_checked(argv: list[str], fragment: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["run", "--ray", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and fragment in err, err


def test_default_worker_count_follows_the_cluster_resources() -> None:
    from wafl.cli.launch.raylaunch import ray_workers

    class Cluster:
        def __init__(self, **resources: float) -> None:
            self.resources = resources

        def cluster_resources(self) -> dict[str, float]:
            return self.resources

    assert ray_workers(Cluster(CPU=9.0), 100, 2.0, 0.0, 1.0) == 4  # (9 - the server's 1) // 2
    assert ray_workers(Cluster(CPU=64.0, GPU=2.0), 100, 1.0, 0.25, 1.0) == 8  # four workers share a GPU
    assert ray_workers(Cluster(CPU=64.0), 3, 1.0, 0.0, 1.0) == 3  # at most one per client
    assert ray_workers(Cluster(CPU=1.0), 10, 4.0, 0.0, 1.0) == 1  # at least one


@pytest.fixture
def two_nodes(monkeypatch: pytest.MonkeyPatch):
    """A Ray cluster of two nodes on this machine, both on 127.0.0.1 only (every Ray process binds and
    advertises loopback): the head (the server and one worker fit) and one more (one worker fits), each
    with a small object store. Ray's memory monitor is off: on a machine shared with other jobs it kills
    actors when the whole machine's memory is 95 % used, whoever uses it."""
    from wafl.cli.launch.raylaunch import LOCAL_ONLY_ENV, LOOPBACK, import_ray

    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    monkeypatch.setenv(LOCAL_ONLY_ENV, "0")  # restored afterwards; the nodes' processes inherit it
    ray = import_ray(loopback=True)  # in the test extras: a missing Ray fails here rather than skipping
    from ray.cluster_utils import Cluster

    store = 100 * 1024 * 1024
    node = {"object_store_memory": store, "node_ip_address": LOOPBACK}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, **node})
    other = cluster.add_node(num_cpus=1, **node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        assert cluster.address.startswith(f"{LOOPBACK}:")
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        yield ray, cluster.head_node.node_id, other.node_id, cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def listening_addresses() -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of the TCP sockets listened on by this
    process and its descendants: here, every process of the test cluster and of the run on it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo += children.get(pid, [])
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.add(fields[1].split(":")[0])
    return found


class RayRun:
    """``wafl run --ray`` of four fedavg clients in two workers (by default) on the test cluster, in a thread: the test
    disturbs the actors meanwhile and then calls :meth:`finish`."""

    def __init__(self, address: str | None, out: Path, rounds: int, slowdown: str, workers: int = 2) -> None:
        argv = ["run", "--ray", *([address] if address else []), "--clients", "4", "--rounds", str(rounds)]
        argv += ["--algorithm", "fedavg"]
        argv += ["--protocol", "compute-and-wait", "--set", "optimizer=adam", "--set", "lr=0.003"]
        argv += ["--set", "local_epochs=2", "--slowdown", slowdown]
        argv += ["--workers", str(workers), "--ray-max-restarts", "2", "--timeout", "420", "--quiet", "--out", str(out)]
        self.namespace = f"wafl-{out.name}"
        self.result: dict[str, object] = {}
        self.thread = threading.Thread(target=self._run, args=(argv,))
        self.thread.start()

    def _run(self, argv: list[str]) -> None:
        try:
            self.result["code"] = main(argv)
        except BaseException as e:  # noqa: BLE001 - re-raised by finish()
            self.result["error"] = e

    def running(self) -> bool:
        return self.thread.is_alive()

    def finish(self) -> object:
        """Waits for the run; re-raises what it raised; returns its exit code."""
        self.thread.join(timeout=480)
        assert not self.thread.is_alive(), "launch_ray did not return"
        if "error" in self.result:
            raise self.result["error"]  # type: ignore[misc]
        return self.result["code"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rounds_on_a_two_node_ray_cluster_with_a_worker_restarted(two_nodes, tmp_path: Path) -> None:
    """Four clients in two worker actors, one on each node, the server beside the driver. Once every client
    has joined, worker 1's state folder is removed and its actor killed (its process dies); Ray restarts it,
    its two clients re-join the same run with the session credentials the driver kept, and both rounds
    complete with all four clients' uploads. The output folder here holds what the server wrote on its node
    and both workers' logs."""
    ray, head, other, address = two_nodes
    out = tmp_path / "run"
    # the clients train 50 x longer (a slowdown sleeps: no more CPU), so the run is still going when worker
    # 1's actor is killed, 4 s after the joins (the time the driver is given to fetch credentials): at 4 x an
    # idle machine finished both rounds within them, and at 12 x a machine twice as fast did too
    run = RayRun(address, out, rounds=2, slowdown="50,50,50,50")
    namespace = run.namespace
    killed_before_round = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.running():
        try:
            server = ray.get_actor("server", namespace=namespace)
            joined = ray.get(server.joined.remote())
        except ValueError:  # not created yet
            joined = 0
        except ray.exceptions.RayActorError:
            joined = 0
        if joined == 4:
            # Ray and the run listen on loopback only: the GCS, both raylets, the actors, the wafl server
            addresses = listening_addresses()
            assert len(addresses) >= 1 and addresses <= LOOPBACK_HEX, addresses
            # As if Ray restarted the worker on another node: its state folder is not there. The clients
            # re-join with the copy of their credentials that the driver fetched (every 2 s) since they joined.
            time.sleep(4.0)
            for state in Path(tempfile.gettempdir()).glob(f"wafl-ray/{out.name}-*/worker-1/clients"):
                shutil.rmtree(state)
            code, rows, _ = ray.get(server.poll.remote())
            killed_before_round = len(rows) + 1
            ray.kill(ray.get_actor("worker-1", namespace=namespace), no_restart=False)
            break
        time.sleep(0.1)
    code = run.finish()
    assert killed_before_round in (1, 2), "the clients never all joined"
    record = json.loads((out / "ray.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, (summary, record)
    assert summary["ok"] and summary["client_codes"] == [0, 0]
    # Every round's results row, every client in it, a GM above chance (0.1 for ten digits).
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and [r["clients"] for r in rows] == [4, 4]
    assert rows[-1]["gm_accuracy"] > 0.3
    # One worker on each node (the first placement of each); the server on the driver's node.
    assert {w["nodes"][0] for w in record["workers"]} == {head, other}
    assert record["server"]["node_id"] == head
    assert record["server"]["host"] == "127.0.0.1"
    assert {ip for w in record["workers"] for ip in w["ips"]} == {"127.0.0.1"}
    assert [w["restarts"] for w in record["workers"]] == [0, 1] and len(set(record["workers"][1]["pids"])) == 2
    events = [json.loads(x) for x in (out / "logs" / "server.jsonl").read_text().splitlines()]
    uploads = {(e["client"], e["round"]) for e in events if e["event"] == "upload.accepted"}
    assert uploads == {(f"client-{i}", r) for i in range(4) for r in (1, 2)}
    rejoined = {e["client"] for e in events if e["event"] == "client.join" and e.get("rejoin")}
    # worker 1's clients (balanced by training samples, as wafl run splits them), with their credentials
    worker_1 = {f"client-{i}" for i in parse_indices(record["workers"][1]["clients"])}
    assert len(worker_1) == 2 and rejoined == worker_1, (rejoined, record["workers"])
    for w in (0, 1):
        lines = [json.loads(x) for x in (out / "logs" / f"worker-{w}.jsonl").read_text().splitlines()]
        assert [x["failed"] for x in lines if x["event"] == "worker.done"] == [0]
    ready = [x for x in (out / "logs" / "worker-1.jsonl").read_text().splitlines() if '"worker.ready"' in x]
    assert len(ready) == 2  # the actor that was killed and the one Ray restarted (one log on the node)
    assert (out / "config.json").exists() and (out / "accuracy.png").exists() and (out / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_server_actor_is_restarted_and_resumes_the_run(two_nodes, tmp_path: Path) -> None:
    """The server actor's process is killed once round 1 is recorded. Ray restarts it beside the driver; the
    new incarnation finds its run folder, listens on the same port and resumes from the round-1 checkpoint;
    the workers' clients reconnect to the address they were given, and all three rounds complete."""
    ray, head, other, address = two_nodes
    out = tmp_path / "run"
    run = RayRun(address, out, rounds=3, slowdown="1,1,8,8")  # round 2 is still going when the server dies
    namespace = run.namespace
    rows_at_kill = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.running():
        try:
            server = ray.get_actor("server", namespace=namespace)
            _, rows, _ = ray.get(server.poll.remote())
        except (ValueError, ray.exceptions.RayActorError):  # not created yet, or not started
            rows = []
        if rows:
            rows_at_kill = len(rows)
            ray.kill(server, no_restart=False)  # its process dies; Ray may restart it
            break
        time.sleep(0.1)
    code = run.finish()
    assert rows_at_kill in (1, 2), "round 1 never completed"
    record = json.loads((out / "ray.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0, (summary, record)
    assert record["server"]["restarts"] == 1 and len(set(record["server"]["pids"])) == 2
    assert record["server"]["node_id"] == head
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows][:rows_at_kill] == list(range(1, rows_at_kill + 1))
    assert sorted({r["round"] for r in rows}) == [1, 2, 3] and rows[-1]["clients"] == 4
    assert rows[-1]["gm_accuracy"] > 0.3
    events = [json.loads(x) for x in (out / "logs" / "server.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "resume"] == [rows_at_kill]  # from its last checkpoint
    uploads = {(e["client"], e["round"]) for e in events if e["event"] == "upload.accepted"}
    assert uploads == {(f"client-{i}", r) for i in range(4) for r in (1, 2, 3)}
    assert summary["ok"] and summary["client_codes"] == [0, 0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_cluster_that_ray_run_starts_is_on_loopback_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``wafl run --ray`` without an address starts a Ray cluster on this machine: every process of it (GCS,
    raylet, the actors) and the wafl server in it listen on 127.0.0.1 only, for the whole run."""
    from wafl.cli.launch.raylaunch import LOCAL_ONLY_ENV

    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    monkeypatch.setenv(LOCAL_ONLY_ENV, "1")  # --ray sets it for the cluster it starts; restored afterwards
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "run"
    run = RayRun(None, out, rounds=1, slowdown="1,1,1,1", workers=1)  # the server and one worker: 2 CPUs
    seen: set[str] = set()
    while run.running():
        seen |= listening_addresses()
        time.sleep(1.0)
    assert run.finish() == 0
    assert seen and seen <= LOOPBACK_HEX, seen
    record = json.loads((out / "ray.json").read_text())
    assert record["server"]["host"] == "127.0.0.1" and record["server"]["ip"] == "127.0.0.1"
    assert {ip for w in record["workers"] for ip in w["ips"]} == {"127.0.0.1"}
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] and rows[0]["clients"] == 4


def test_workers_the_cluster_cannot_hold_are_named_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """``--workers`` beyond the cluster's CPUs (or GPUs) is warned about at once, with what is needed and
    what the cluster has, instead of only surfacing as a join timeout."""
    from wafl.cli.launch.raylaunch import warn_unplaceable

    assert warn_unplaceable({"CPU": 8.0}, 3, 1.0, 0.0, 1.0) == ""  # 1 + 3 x 1 CPUs fit
    text = warn_unplaceable({"CPU": 2.0}, 3, 1.0, 0.0, 1.0)
    assert "--workers 3 needs 4 CPUs, it has 2" in text and "join_timeout_s" in text
    assert text in capsys.readouterr().err
    gpus = warn_unplaceable({"CPU": 16.0, "GPU": 1.0}, 4, 1.0, 0.5, 1.0)
    assert "2 GPUs, it has 1" in gpus and "CPUs" not in gpus
