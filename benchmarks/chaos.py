"""Chaos test: a federation of real ``wafl server`` / ``wafl client`` processes under a seeded schedule of faults.

``python benchmarks/chaos.py [--minutes 15] [--seed 0] [--clients 20] [--aggregation sync|buffered]
[--protocol wait-free|compute-and-wait] [--all] [--smoke] [--link-rate 20mbit|none]``

The driver imports PyTorch and wafl once and forks every process from itself (as ``wafl run`` does,
``wafl.cli.launch.forking``): the server (``wafl server --enrollment``, ``--resume`` after a kill) and one
``wafl client --index I --token-file secrets/client-I.secret`` per client, each the real command's
``main``. As root, every process runs in its own network namespace behind a tc tbf link (``wafl.cli.launch.netns.Star``,
the links of ``wafl run --link-rate``; the child enters its namespace with setns(2) before ``main``);
otherwise everything talks over 127.0.0.1 and the link faults are left out. ``tc netem`` (loss, delay) is
used where the kernel has it (checked at start; the report says whether).

Faults, drawn from ``--seed`` (kinds in turn, a random target and downtime each):

* ``client_kill_state``: a client SIGKILLed, restarted with its ``--state-dir``;
* ``client_kill_nostate``: a client SIGKILLed, restarted without ``--state-dir`` (its state lost);
* ``server_kill``: the server SIGKILLed, restarted with ``--resume``;
* ``mid_upload_stop``: a client stops itself (SIGSTOP) inside its next upload stream, is SIGKILLed there and
  restarted with its state (``benchmarks/_chaos_hooks.py``);
* ``link_drop`` (namespaces only): a client's link taken down (its bridge port) and restored;
* ``mid_upload_cut`` (namespaces only): a client's link cut while its next upload stream is open (the stream
  pauses after its first message so the cut lands inside it) and restored;
* ``client_away``: a client SIGKILLed and restarted with its state three round deadlines later.

Measured from the server's JSON-lines logs (one per incarnation: ``upload.accepted`` client/round,
``round.done``, ``resume``) and each client's events file (``upload.ack``: the uploads it saw acknowledged):
versions made per minute, the longest stall (time between successive versions, and from the start to the
first), every client's share of the versions' accepted uploads, lost updates (acknowledged to a client but
absent from that server incarnation's accepted uploads), doubled updates (one client's upload for one round
accepted twice by one incarnation, or accepted again after a resume from a checkpoint that already held it),
tracebacks in any process's output or log, and for each restart (or restored link) the versions made until the
client's next accepted upload. Targets: no stall longer than two round deadlines, none lost or doubled, no traceback,
every restarted client that stayed alive back within one round of its restart (a restored link is reported the
same way but not judged: TCP's retransmission backoff alone can keep a connection silent after its link is back;
a server killed between the restart and the return moves the count's start to the server's return) (sync: one
version; buffered:
``ceil(concurrency / buffer_size)`` versions, those in which every training client uploads once; a restart
faulted again before its return is not judged).

The server logs no idempotency keys with its accepted uploads, so uploads are matched by (client, round):
the strategy accepts at most one upload per client and round (``Strategy.accepted``), which is the same key.

Saved as JSON under ``benchmarks/results/chaos/`` with the commit; exit status 0 when every target held.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from wafl.cli.launch.forking import ForkedProcess, fork_main

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

COMBOS = [(a, p) for a in ("sync", "buffered") for p in ("wait-free", "compute-and-wait")]
KINDS = [
    "client_kill_state",
    "client_kill_nostate",
    "server_kill",
    "mid_upload_stop",
    "link_drop",
    "mid_upload_cut",
    "client_away",
]
LINK_KINDS = {"link_drop", "mid_upload_cut"}
CLONE_NEWNET = 0x40000000
TOKEN_ENV = "WAFL_TOKEN"


# ----------------------------------------------------------------------------------------- processes
def _setns(namespace: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {namespace}")
    finally:
        os.close(fd)


def _wafl_main(argv: list[str]) -> int:
    from wafl.cli.main import main  # in the child, after its hooks are in place

    return main(argv)


def _enter(namespace: str | None, hooks: tuple[Path, Path] | None) -> None:
    """In a forked child, before ``wafl``'s entry point: its network namespace and the upload hooks."""
    if namespace:
        _setns(namespace)
    if hooks:
        import _chaos_hooks

        _chaos_hooks.install(*hooks)


class Proc(ForkedProcess):
    """A forked child running ``wafl.cli.main.main(argv)`` (:func:`~wafl.cli.launch.forking.fork_main`) in
    ``namespace``, with the upload ``hooks`` where given; stdout and stderr appended to ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, namespace: str | None, hooks: tuple[Path, Path] | None):
        child = fork_main(argv, log, None, _wafl_main, prepare=functools.partial(_enter, namespace, hooks), append=True)
        super().__init__(child.pid, argv)
        self.name = name
        self.argv = argv
        self.log = log

    def stopped(self) -> bool:
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(self.pid, 0)
                self.returncode = -9
            except ChildProcessError:
                pass


# ----------------------------------------------------------------------------------------- schedule
@dataclass
class Fault:
    at_s: float
    kind: str
    target: str = ""
    down_s: float = 0.0
    done: dict[str, Any] = field(default_factory=dict)


def schedule(
    seed: int, duration_s: float, kinds: Sequence[str], per_kind: int, down_s: tuple[float, float]
) -> list[Fault]:
    """``per_kind`` faults of every kind, at seeded times in the middle 80% of the run, each with a downtime."""
    rng = random.Random(seed)
    lo, hi = 0.12 * duration_s, 0.82 * duration_s
    faults = []
    for kind in kinds:
        for _ in range(per_kind):
            faults.append(Fault(rng.uniform(lo, hi), kind, down_s=round(rng.uniform(*down_s), 2)))
    faults.sort(key=lambda f: f.at_s)
    return faults


# ----------------------------------------------------------------------------------------- one federation
def _netem_available() -> bool:
    ns = f"waflnetem-{os.getpid()}"
    if os.geteuid() != 0 or shutil.which("tc") is None:
        return False
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        p = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "5ms"],
            capture_output=True,
        )
        return p.returncode == 0
    except (OSError, subprocess.CalledProcessError):
        return False
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Federation:
    def __init__(self, a: argparse.Namespace, aggregation: str, protocol: str, out: Path, duration_s: float, seed: int):
        self.a = a
        self.out = out
        self.duration_s = duration_s
        self.aggregation = aggregation
        self.protocol = protocol
        self.seed = seed
        self.n = a.clients
        self.star: Any = None
        self.netem = False
        self.procs: dict[str, Proc] = {}
        self.incarnation = 0
        self.timeline: list[dict[str, Any]] = []  # driver events: starts, kills, faults
        self.pending: list[tuple[float, str, Any]] = []  # (time, action, argument)

    # -- setup
    def setup(self) -> None:
        from wafl.common.config import RunConfig

        shutil.rmtree(self.out, ignore_errors=True)
        (self.out / "logs").mkdir(parents=True)
        (self.out / "clients").mkdir()
        (self.out / "flags").mkdir()
        sets = dict(
            num_clients=self.n,
            rounds=100_000,
            round_deadline_s=self.a.deadline,
            local_epochs=1,
            eval_every=self.a.eval_every,
            aggregation=self.aggregation,
            protocol=self.protocol,
            seed=self.seed,
            final_report_s=1.0,
        )
        for kv in self.a.set or []:
            k, _, v = kv.partition("=")
            try:
                sets[k] = json.loads(v)
            except json.JSONDecodeError:
                sets[k] = v
        cfg = RunConfig.from_mapping(sets).validate()
        self.cfg = cfg
        (self.out / "run.json").write_text(cfg.to_json())
        argv = ["enroll", "--clients", str(self.n), "--out", str(self.out / "enroll.txt"),
                "--secrets-dir", str(self.out / "secrets")]  # fmt: skip
        enroll = Proc("enroll", argv, self.out / "logs" / "enroll.out", None, None)
        while enroll.poll() is None:
            time.sleep(0.05)
        if enroll.returncode != 0:
            raise RuntimeError("wafl enroll failed: " + (self.out / "logs" / "enroll.out").read_text())
        self.host, self.port = "127.0.0.1", _free_port()
        if self.a.link_rate != "none" and os.geteuid() == 0:
            from wafl.cli.launch.netns import Star, check_permissions

            check_permissions()
            from wafl.common.rates import parse_rate

            self.star = Star(
                self.n, self.a.link_rate, prefix="chaos", server_rate=self.n * parse_rate(self.a.link_rate)
            )
            self.host, self.port = self.star.server_address, 50051
            self.netem = _netem_available()
            if self.netem:
                from wafl.cli.launch.netns import tbf_command

                for i in range(self.n):  # loss and delay on each client's upload link, under its tbf
                    ns = self.star.namespace(f"client{i}")
                    tbf = tbf_command("eth0", parse_rate(self.a.link_rate))
                    tbf[6:6] = ["handle", "1:"]
                    _ip("netns", "exec", ns, *tbf)
                    _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:",
                        "netem", "delay", "20ms", "5ms", "loss", "0.5%")  # fmt: skip

    @property
    def shaped(self) -> bool:
        return self.star is not None

    def log(self, event: str, **fields: Any) -> None:
        self.timeline.append({"t": time.time(), "event": event, **fields})

    # -- processes
    def start_server(self, resume: bool) -> None:
        self.incarnation += 1
        argv = ["server", "--config", str(self.out / "run.json"), "--host", self.host, "--port", str(self.port),
                "--out", str(self.out / "server"), "--enrollment", str(self.out / "enroll.txt"),
                "--log-file", str(self.out / "logs" / f"server-{self.incarnation}.jsonl"),
                "--threads", "1", "--quiet"]  # fmt: skip
        if resume:
            argv.append("--resume")
        ns = self.star.namespace("server") if self.star else None
        self.procs["server"] = Proc("server", argv, self.out / "logs" / "server.out", ns, None)
        self.log("server.start", incarnation=self.incarnation, resume=resume)

    def start_client(self, i: int, state: bool = True) -> None:
        argv = ["client", "--server", f"{self.host}:{self.port}", "--index", str(i),
                "--token-file", str(self.out / "secrets" / f"client-{i}.secret"),
                "--log-file", str(self.out / "logs" / f"client-{i}.jsonl"), "--threads", "1", "--quiet",
                "--reconnect-s", "600"]  # fmt: skip
        if state:
            argv += ["--state-dir", str(self.out / "clients" / f"client-{i}")]
        ns = self.star.namespace(f"client{i}") if self.star else None
        hooks = (self.out / "logs" / f"client-{i}.events.jsonl", self.out / "flags" / f"client-{i}")
        self.procs[f"client-{i}"] = Proc(f"client-{i}", argv, self.out / "logs" / f"client-{i}.out", ns, hooks)

    def link(self, i: int, up: bool) -> None:
        _ip("-n", self.star._bridge_ns, "link", "set", f"c{i}", "up" if up else "down")

    def live_clients(self) -> list[int]:
        """Clients running with their link up and no fault of theirs in progress."""
        busy = {arg[0] for _, a, arg in self.pending if a != "server_resume"}
        return [i for i in range(self.n) if (p := self.procs.get(f"client-{i}")) and p.poll() is None and i not in busy]

    def kill_client(self, i: int, kind: str) -> None:
        self.procs[f"client-{i}"].kill()
        (self.out / "flags" / f"client-{i}").unlink(missing_ok=True)  # a fault order the dead process left unread
        self.log("client.kill", client=i, kind=kind)

    # -- faults
    def fire(self, f: Fault, rng: random.Random) -> None:
        now = time.time()
        if f.kind == "server_kill":
            if self.procs["server"].poll() is not None or any(a == "server_resume" for _, a, _ in self.pending):
                f.done = {"skipped": "server already down"}
                return
            self.procs["server"].kill()
            f.target = "server"
            self.pending.append((now + f.down_s, "server_resume", None))
            f.done = {"t": now}
            self.log("server.kill")
            return
        live = self.live_clients()
        if not live:
            f.done = {"skipped": "no live client"}
            return
        i = rng.choice(live)
        f.target = f"client-{i}"
        f.done = {"t": now}
        if f.kind in ("client_kill_state", "client_kill_nostate", "client_away"):
            self.kill_client(i, f.kind)
            down = 3 * self.a.deadline if f.kind == "client_away" else f.down_s  # away for longer than a round
            self.pending.append((now + down, "restart", (i, f.kind != "client_kill_nostate", f.kind)))
        elif f.kind == "mid_upload_stop":
            (self.out / "flags" / f"client-{i}").write_text("stop")
            self.pending.append((now + 0.2, "await_stop", (i, now + 4 * self.a.deadline, f.down_s)))
        elif f.kind == "link_drop":
            self.link(i, False)
            self.log("link.down", client=i)
            self.pending.append((now + f.down_s, "link_up", (i,)))
        elif f.kind == "mid_upload_cut":
            (self.out / "flags" / f"client-{i}").write_text(f"hold {f.down_s + 2:.1f}")
            self.pending.append((now + 0.1, "await_held", (i, now + 4 * self.a.deadline, f.down_s)))

    def _held(self, i: int, since: float) -> bool:
        path = self.out / "logs" / f"client-{i}.events.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return False
        return any(json.loads(x)["event"] == "upload.held" and json.loads(x)["t"] >= since for x in lines[-20:])

    def act(self, now: float, action: str, arg: Any) -> None:
        if action == "server_resume":
            self.start_server(resume=True)
        elif action == "restart":
            i, state, kind = arg
            folder = self.out / "clients" / f"client-{i}"
            if not state:
                shutil.rmtree(folder, ignore_errors=True)
            # after a restart without its folder, the next one with it finds the folder empty
            files = len(list(folder.iterdir())) if state and folder.is_dir() else 0
            self.start_client(i, state=state)
            self.log("client.restart", client=i, kind=kind, state=state, state_files=files)
        elif action == "link_up":
            self.link(arg[0], True)
            self.log("link.up", client=arg[0])
        elif action == "await_stop":
            i, give_up, down = arg
            p = self.procs[f"client-{i}"]
            if p.poll() is not None:
                return
            if p.stopped():
                self.kill_client(i, "mid_upload_stop")
                self.pending.append((now + down, "restart", (i, True, "mid_upload_stop")))
            elif now < give_up:
                self.pending.append((now + 0.1, action, arg))
            else:
                (self.out / "flags" / f"client-{i}").unlink(missing_ok=True)
                self.log("fault.missed", client=i, kind="mid_upload_stop")
        elif action == "await_held":
            i, give_up, down = arg
            if self._held(i, give_up - 4 * self.a.deadline):  # since the fault was fired
                self.link(i, False)
                self.log("link.down", client=i, kind="mid_upload_cut")
                self.pending.append((now + down, "link_up", (i,)))
            elif now < give_up:
                self.pending.append((now + 0.05, action, arg))
            else:
                (self.out / "flags" / f"client-{i}").unlink(missing_ok=True)
                self.log("fault.missed", client=i, kind="mid_upload_cut")

    # -- the run
    def run(self) -> dict[str, Any]:
        self.setup()
        kinds = [k for k in self.a.kinds if self.star or k not in LINK_KINDS]
        try:
            self.start_server(resume=False)
            for i in range(self.n):
                self.start_client(i)
            t0 = self._wait_first_join()
            self.t0 = t0
            faults = schedule(self.seed, self.duration_s, kinds, self.a.per_kind, (self.a.down_min, self.a.down_max))
            self.faults = faults
            rng = random.Random(self.seed + 1)
            queue = list(faults)
            while (now := time.time()) < t0 + self.duration_s:
                while queue and t0 + queue[0].at_s <= now:
                    self.fire(queue.pop(0), rng)
                due = [p for p in self.pending if p[0] <= now]
                self.pending = [p for p in self.pending if p[0] > now]
                for _t, action, arg in sorted(due, key=lambda p: p[0]):
                    self.act(now, action, arg)
                for name, p in self.procs.items():
                    if p.poll() is not None and not getattr(p, "_seen", False):
                        p._seen = True  # type: ignore[attr-defined]
                        if p.returncode != -9:
                            self.log("process.exit", process=name, code=p.returncode)
                time.sleep(0.05)
            self.t_end = time.time()
        finally:
            for p in self.procs.values():
                if p.stopped():
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
            if self.star is not None:
                self.star.close()
            with open(self.out / "driver.jsonl", "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.timeline)
            meta = {"t0": getattr(self, "t0", None), "t_end": getattr(self, "t_end", None), "seed": self.seed,
                    "incarnation": self.incarnation, "netem": self.netem, "shaped": self.star is not None,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.a).items()}}  # fmt: skip
            (self.out / "driver.json").write_text(json.dumps(meta))
            faults_done = [{"at_s": f.at_s, "kind": f.kind, "target": f.target, "down_s": f.down_s, "done": f.done}
                           for f in getattr(self, "faults", [])]  # fmt: skip
            (self.out / "faults.json").write_text(json.dumps(faults_done))
        return analyse(self, faults)

    def _wait_first_join(self) -> float:
        deadline = time.time() + 600
        log = self.out / "logs" / "server-1.jsonl"
        while time.time() < deadline:
            if log.exists() and '"run.start"' in log.read_text():
                return time.time()
            if self.procs["server"].poll() is not None:
                raise RuntimeError(
                    "the server exited before the run began: " + (self.out / "logs" / "server.out").read_text()
                )
            time.sleep(0.2)
        raise RuntimeError("the clients did not join within 600 s")


# ----------------------------------------------------------------------------------------- analysis
class Saved(Federation):
    """A finished run's folder (``driver.json``, ``driver.jsonl``, the logs), to judge again (``--reanalyse``)."""

    def __init__(self, run_dir: Path) -> None:
        from wafl.common.config import RunConfig

        meta = json.loads((run_dir / "driver.json").read_text())
        a = argparse.Namespace(**meta["args"])
        cfg = RunConfig.from_json((run_dir / "run.json").read_text())
        super().__init__(a, cfg.rule.aggregation, cfg.client.protocol, run_dir, 0.0, meta["seed"])
        self.cfg = cfg
        self.t0, self.t_end, self.incarnation, self.netem = (
            meta["t0"],
            meta["t_end"],
            meta["incarnation"],
            meta["netem"],
        )
        self._shaped = meta["shaped"]
        self.timeline = _jsonl(run_dir / "driver.jsonl")

    @property
    def shaped(self) -> bool:
        return self._shaped


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by SIGKILL
    return out


def analyse(fed: Federation, faults: list[Fault]) -> dict[str, Any]:
    out, t0, t_end, n = fed.out, fed.t0, fed.t_end, fed.n
    deadline = fed.a.deadline
    cfg = fed.cfg
    if cfg.rule.aggregation == "sync":
        per_round = 1
    else:  # the versions in which every training client uploads once: concurrency / buffer_size (FedAsync: each)
        concurrency = cfg.rule.concurrency or n
        size = 1 if cfg.rule.aggregation == "fedasync" else cfg.rule.buffer_size or max(1, concurrency // 2)
        per_round = -(-concurrency // size)
    incs = []
    for k in range(1, fed.incarnation + 1):
        ev = _jsonl(out / "logs" / f"server-{k}.jsonl")
        for e in ev:
            e["t"] = _ts(e["timestamp"]) if "timestamp" in e else 0.0
        incs.append(ev)
    starts = [e["t"] for e in fed.timeline if e["event"] == "server.start"]
    # versions made (any incarnation), in time order
    versions = sorted((e["t"], e["round"], k) for k, ev in enumerate(incs) for e in ev if e["event"] == "round.done")
    resumed_at = [next((e.get("round", 0) for e in ev if e["event"] == "resume"), 0) for ev in incs]
    times = [t0] + [t for t, _, _ in versions if t0 <= t <= t_end] + [t_end]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    longest = max(gaps) if gaps else t_end - t0
    where = times[gaps.index(longest)] - t0 if gaps else 0.0
    # accepted uploads per incarnation, and what each client saw acknowledged
    accepted: list[list[tuple[str, int, float]]] = [
        [(e["client"], int(e["round"]), e["t"]) for e in ev if e["event"] == "upload.accepted"] for ev in incs
    ]
    acks = []
    for i in range(n):
        for e in _jsonl(out / "logs" / f"client-{i}.events.jsonl"):
            if e["event"] == "upload.ack":
                acks.append((f"client-{i}", int(e["round"]), e["t"]))

    def incarnation_at(t: float) -> int:
        k = 0
        for j, s in enumerate(starts):
            if s <= t:
                k = j
        return k

    lost, doubled, forgotten = [], [], []
    for c, r, t in acks:
        k = incarnation_at(t)
        if not any(cc == c and rr == r and ta <= t + 1.0 for cc, rr, ta in accepted[k]):
            lost.append({"client": c, "round": r, "acked_t_s": round(t - t0, 2), "incarnation": k + 1})
    durable: dict[tuple[str, int], int] = {}
    for k, acc in enumerate(accepted):
        seen: dict[tuple[str, int], int] = {}
        for c, r, _ in acc:
            seen[(c, r)] = seen.get((c, r), 0) + 1
        for key, count in seen.items():
            if count > 1:
                doubled.append({"client": key[0], "round": key[1], "incarnation": k + 1, "times": count})
            if key in durable:
                doubled.append({"client": key[0], "round": key[1], "incarnation": k + 1,
                                "again_after": durable[key]})  # fmt: skip
        next_resume = resumed_at[k + 1] if k + 1 < len(incs) else None
        done_t = [(e["t"], int(e["round"])) for e in incs[k] if e["event"] == "round.done"]
        for c, r, ta in acc:
            # durable: held by the checkpoint the next incarnation resumed from. Sync: its round is at most the
            # resumed round. Buffered (which version folds it is not logged): a version built after it and the
            # one after that both checkpointed (conservative: a double at the boundary goes unseen)
            if next_resume is None:
                ok = any(td >= ta for td, _ in done_t)
            elif fed.aggregation == "sync":
                ok = r <= next_resume
            else:
                ok = any(td >= ta and v < next_resume for td, v in done_t)
            if ok:
                durable.setdefault((c, r), k + 1)
            elif next_resume is not None:
                forgotten.append({"client": c, "round": r, "incarnation": k + 1})
    # each client's share of accepted uploads that went into versions
    per_client = {f"client-{i}": 0 for i in range(n)}
    for (c, _), _k in durable.items():
        per_client[c] = per_client.get(c, 0) + 1
    total = sum(per_client.values()) or 1
    share = {c: round(v / total, 4) for c, v in per_client.items()}
    # restarts: versions until the client's next accepted upload
    restarts = []
    all_acc = sorted((t, c) for acc in accepted for c, _, t in acc)
    vtimes = [t for t, _, _ in versions]
    server_up = sorted(starts)
    for e in fed.timeline:
        if e["event"] not in ("client.restart", "link.up"):  # a client's return: a new process, or its link back
            continue
        if e["event"] == "link.up":
            e = {**e, "kind": "link_restored"}
        c = f"client-{e['client']}"
        t_r = e["t"]
        # a restart while the server was down counts from the server's return
        kills = [x["t"] for x in fed.timeline if x["event"] == "server.kill" and x["t"] <= t_r]
        if kills and not any(kills[-1] < s <= t_r for s in server_up):
            t_r = min((s for s in server_up if s > t_r), default=t_r)
        back = next((t for t, cc in all_acc if cc == c and t > t_r), None)
        # killed again (or its link cut) before it was back: this restart was not given its chance
        again = next((x["t"] for x in fed.timeline if x["event"] in ("client.kill", "link.down")
                      and x.get("client") == e["client"] and x["t"] > e["t"]), None)  # fmt: skip
        interrupted = again is not None and (back is None or again < back)
        if interrupted:
            back = None
        # the server killed after it and before its return: counted from the server's next start
        down = [x["t"] for x in fed.timeline if x["event"] == "server.kill" and t_r < x["t"] < (back or again or t_end)]
        if down:
            t_r = min((s for s in server_up if s > down[-1]), default=t_end)
        alive = not any(x["event"] == "process.exit" and x.get("process") == c for x in fed.timeline)
        made = sum(1 for t in vtimes if t_r < t <= (back or (again if interrupted else None) or t_end))
        restarts.append({"client": c, "kind": e["kind"], "at_s": round(e["t"] - t0, 2), "alive_at_end": alive,
                         "interrupted": interrupted, "server_restarted_meanwhile": bool(down),
                         "state_files": e.get("state_files"),
                         "back_s": None if back is None else round(back - e["t"], 2),
                         "versions_until_back": made if back is not None else None,
                         "versions_after_without_return": None if back is not None else made})  # fmt: skip
    # tracebacks: printed ones in any output or log, and exceptions a JSON log recorded with their frames
    tracebacks: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for f in sorted((out / "logs").iterdir()):
        text = f.read_text(errors="replace")
        if "Traceback" in text:
            lines = text.splitlines()
            first = next(j for j, x in enumerate(lines) if "Traceback" in x)
            tracebacks.append({"file": f.name, "count": text.count("Traceback"), "excerpt": lines[first : first + 40]})
        if f.suffix == ".jsonl":
            logged = [e for e in _jsonl(f) if e.get("exception") or e.get("level") in ("error", "critical")]
            for e in logged:
                exc = e.get("exception")
                top = exc[-1] if isinstance(exc, list) and exc and isinstance(exc[-1], dict) else {}
                errors.append({"file": f.name, "event": str(e.get("event"))[:200], "exc_type": top.get("exc_type"),
                               "exc_value": str(top.get("exc_value"))[:300] if top else None})  # fmt: skip
            excs = [x for x in errors if x["file"] == f.name and x["exc_type"]]
            if excs:
                kinds = sorted({f"{x['exc_type']}: {x['exc_value']}" for x in excs})
                tracebacks.append({"file": f.name, "count": len(excs), "excerpt": kinds[:10]})
    exits = [e for e in fed.timeline if e["event"] == "process.exit"]
    minutes = (t_end - t0) / 60
    made_in_run = [t for t in vtimes if t0 <= t <= t_end]
    targets = {
        "no_stall_over_two_deadlines": longest <= 2 * deadline,
        "no_update_lost_or_doubled": not lost and not doubled,
        "no_traceback": not tracebacks,
        "clients_back_within_one_round": all(
            (r["versions_until_back"] is not None and r["versions_until_back"] <= per_round)
            or (r["versions_until_back"] is None and (r["versions_after_without_return"] or 0) <= per_round)
            for r in restarts
            if r["alive_at_end"] and not r["interrupted"] and r["kind"] != "link_restored"
        ),
        "no_process_died": not exits,
    }
    return {
        "aggregation": fed.aggregation,
        "protocol": fed.protocol,
        "clients": n,
        "seed": fed.seed,
        "round_deadline_s": deadline,
        "link_rate": fed.a.link_rate if fed.shaped else None,
        "netem": fed.netem,
        "duration_s": round(t_end - t0, 1),
        "versions": len(made_in_run),
        "last_version": max((r for _, r, _ in versions), default=0),
        "versions_per_minute": round(len(made_in_run) / minutes, 2) if minutes > 0 else 0.0,
        "longest_stall_s": round(longest, 2),
        "longest_stall_at_s": round(where, 1),
        "stall_limit_s": 2 * deadline,
        "versions_per_round": per_round,
        "client_share": share,
        # accepted uploads per version made: under sync the share of rounds each client took part in
        "client_rounds": {c: round(v / max(1, len(made_in_run)), 3) for c, v in per_client.items()},
        "uploads_acked": len(acks),
        "uploads_accepted": sum(len(a) for a in accepted),
        "lost": lost,
        "doubled": doubled,
        "forgotten_in_server_crash": len(forgotten),
        "tracebacks": tracebacks,
        "logged_errors": len(errors),
        "logged_error_kinds": sorted({f"{str(x['file']).split('-')[0]}: {x['event']}" for x in errors})[:20],
        "process_exits": exits,
        "restarts": restarts,
        "faults": [
            {
                "at_s": round(f.at_s, 1),
                "kind": f.kind,
                "target": f.target,
                "down_s": f.down_s,
                **({"skipped": f.done["skipped"]} if "skipped" in f.done else {}),
            }
            for f in faults
        ],  # fmt: skip
        "faults_missed": [e for e in fed.timeline if e["event"] == "fault.missed"],
        "server_incarnations": fed.incarnation,
        "targets": targets,
        "passed": all(targets.values()),
    }


# ----------------------------------------------------------------------------------------- main
def _commit() -> tuple[str, bool]:
    """The commit measured (40 hex digits) and whether tracked files differed from it."""
    from wafl.cli.report.provenance import git_commit

    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    return git_commit() or "unknown", bool(dirty)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/chaos.py", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15.0, help="run time (with --all: divided between the four)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--aggregation", choices=["sync", "buffered"], default="sync")
    p.add_argument("--protocol", choices=["wait-free", "compute-and-wait"], default="wait-free")
    p.add_argument("--all", action="store_true", help="the four aggregation x protocol combinations in turn")
    p.add_argument("--smoke", action="store_true", help="6 clients, 1 minute, 2 faults of each kind")
    p.add_argument("--link-rate", default="20mbit", help="each host's link as root (none: loopback)")
    p.add_argument("--deadline", type=float, default=20.0, help="round_deadline_s")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--per-kind", type=int, default=0, help="faults of each kind (default: one per 1.5 minutes)")
    p.add_argument("--down-min", type=float, default=1.0, help="shortest downtime of a fault, seconds")
    p.add_argument("--down-max", type=float, default=6.0)
    p.add_argument("--kinds", help=f"faults to draw, comma-separated (default: {','.join(KINDS)})")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="another run configuration field")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "chaos")
    p.add_argument("--runs", type=Path, default=Path("runs") / "chaos", help="the federations' folders")
    p.add_argument("--reanalyse", type=Path, nargs="+", metavar="RUN_DIR", help="judge finished runs' folders again")
    a = p.parse_args(argv)
    if a.smoke:
        a.clients = 6 if a.clients == 20 else a.clients
        a.minutes = 1.0 if a.minutes == 15.0 else a.minutes
        a.per_kind = a.per_kind or 2
        a.deadline = 10.0 if a.deadline == 20.0 else a.deadline
        a.eval_every = 1000 if a.eval_every == 5 else a.eval_every
    if a.kinds is None:
        a.kinds = ",".join(KINDS)
    a.kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not a.kinds or set(a.kinds) - set(KINDS):
        p.error(f"--kinds {','.join(a.kinds)!r}: choose among {', '.join(KINDS)}")
    if a.minutes <= 0:
        p.error("--minutes must be positive")
    if a.clients < 2:
        p.error("--clients must be at least 2")
    if a.deadline <= 0:
        p.error("--deadline must be positive")
    if a.per_kind < 0 or a.down_min <= 0 or a.down_max < a.down_min:
        p.error("--per-kind must be >= 0 and 0 < --down-min <= --down-max")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    if a.reanalyse:
        again = [analyse(fed, [Fault(**f) for f in json.loads((d / "faults.json").read_text())])
                 for d in a.reanalyse for fed in [Saved(d)]]  # fmt: skip
        for r in again:
            _print(r)
        print(json.dumps(again, indent=1), file=sys.stderr)
        return 0 if all(r["passed"] for r in again) else 1
    from wafl.cli.launch import forking

    if not forking.can_fork():
        print("chaos: this process cannot fork its federation (threads or gRPC already started)", file=sys.stderr)
        return 2
    forking.preload()  # torch and wafl once; every process of the federation is forked from here
    combos = COMBOS if a.all else [(a.aggregation, a.protocol)]
    minutes = a.minutes / len(combos)
    per_kind = a.per_kind or max(1, round(minutes / 1.5))
    a.per_kind = per_kind
    commit, dirty = _commit()
    results = []
    for agg, proto in combos:
        print(f"chaos: {agg} / {proto}: {a.clients} clients, {minutes:g} min, seed {a.seed}", flush=True)
        fed = Federation(a, agg, proto, a.runs / f"{agg}-{proto}-seed{a.seed}", minutes * 60, a.seed)
        r = fed.run()
        results.append(r)
        _print(r)
    doc = {
        "commit": commit,
        "uncommitted_changes": dirty,
        "seed": a.seed,
        "minutes": a.minutes,
        "smoke": a.smoke,
        "clients": a.clients,
        "kinds": a.kinds,
        "per_kind": a.per_kind,
        "root": os.geteuid() == 0,
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "runs": results,
        "passed": all(r["passed"] for r in results),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    what = "all" if a.all else f"{a.aggregation}-{a.protocol}"
    path = a.out / f"chaos-{'smoke-' if a.smoke else ''}{what}-seed{a.seed}-{commit[:7]}.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"chaos: {'PASS' if doc['passed'] else 'FAIL'}; saved {path}")
    return 0 if doc["passed"] else 1


def _print(r: dict[str, Any]) -> None:
    print(f"  versions {r['versions']} ({r['versions_per_minute']}/min), longest stall {r['longest_stall_s']} s "
          f"(limit {r['stall_limit_s']} s), acked {r['uploads_acked']}, accepted {r['uploads_accepted']}, "
          f"lost {len(r['lost'])}, doubled {len(r['doubled'])}, tracebacks {len(r['tracebacks'])}, "
          f"server incarnations {r['server_incarnations']}, netem {r['netem']}")  # fmt: skip
    shares = sorted(r["client_share"].values())
    rounds = sorted(r["client_rounds"].values())
    print(f"  client share of accepted uploads: min {shares[0]}, max {shares[-1]}; uploads per version made: "
          f"min {rounds[0]}, max {rounds[-1]}")  # fmt: skip
    for x in r["restarts"]:
        if x["interrupted"]:
            print(f"  restart {x['client']} ({x['kind']}) at {x['at_s']} s: faulted again before it was back")
            continue
        print(f"  restart {x['client']} ({x['kind']}) at {x['at_s']} s: back after {x['versions_until_back']} "
              f"versions, {x['back_s']} s")  # fmt: skip
    for t in r["tracebacks"]:
        print(f"  traceback in {t['file']} ({t['count']}): {t['excerpt'][-1] if t['excerpt'] else ''}")
    for x in r["lost"] + r["doubled"]:
        print(f"  {'lost' if x in r['lost'] else 'doubled'}: {x}")
    for k, v in r["targets"].items():
        print(f"  {'PASS' if v else 'FAIL'} {k}")


if __name__ == "__main__":
    sys.exit(main())
