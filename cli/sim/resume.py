"""Snapshots of an in-process run between two versions, and the resumption of a killed run from its last one.

A long in-process run (a sweep point of several hours) can outlast the machine's sitting. Given
:class:`Snapshots`, :func:`~wafl.cli.sim.simulate.simulate` pauses now and then between two versions (after a
version's results line, before the next version is published; never after the last version or a plateau
stop), waits until every client is done with the models it was sent (trained, uploaded, reported), and writes
into the run's ``resume/`` folder:

* ``engine-<v>.pt``: the engine's checkpoint after version ``v`` (global model, the algorithm's server state,
  knowledge, committed uploads, norm history, index owners, run id), as ``wafl server`` writes it;
* then ``state.pt``, in place of the one before: what else the next rounds depend on. Each client's trainer
  (:meth:`~wafl.client.trainer.Trainer.snapshot`: models, the PM optimizer's state, the algorithm's client
  state such as SCAFFOLD's control variate or FedDyn's gradient, both random generators) and protocol (the
  round whose PM it has still to evaluate and report, the bytes it uploaded); the results lines not yet
  written (:meth:`~wafl.server.results.ResultsLog.state_dict`), the lengths of ``results.jsonl`` and
  ``reports.jsonl`` (synced first), the bytes sent since the last line and the run's clock. It names its
  ``engine-<v>.pt``; the engine files of other versions are removed once it is in place.

Each file is written to a temporary file and renamed (:mod:`wafl.common.verified`, checksummed), so a kill
at any moment leaves the last complete snapshot, or none; :class:`Snapshots` ignores (and logs) one that
cannot be used, and the run then starts from round 1.

A run whose folder holds a usable snapshot resumes from it: the results files are cut back to their lengths
then (the lines written after it are written again), the engine is built from its checkpoint
(``resume=True``, the path of ``wafl server --resume``: its plateau watch reads the lines up to the snapshot
back, and is given the lines that were still waiting), and each client is built anew and given its state;
its session joins with the credential of its index. The resumed run writes the results lines an
uninterrupted run writes, and stops where it stops (timing fields aside: ``wall_s`` goes on from the
snapshot's). ``timelines.json`` holds the last sitting's timelines. A snapshot records the code's version
it was taken under (a sweep gives the commit); a run resumed under another one goes on, and logs
``resume.other_code``, since the numbers are those of two versions of the code if the change touched them.

Which runs can resume (:func:`not_resumable`): sync aggregation, no new clients, and the compute-and-wait
protocol or an algorithm without a personal phase (its wait-free and adaptive runs then train as
compute-and-wait does). The others could not resume exactly: a wait-free or adaptive PM trains until the
next broadcast (its steps depend on timing), buffered and FedAsync versions depend on the order the uploads
arrive in, and a resumed engine does not send the new clients the model they had still to adapt. They start
again from round 1.

How often: every ``every`` versions, or by default (0) after the first version and then whenever the time
since the last snapshot has reached :data:`COST_FACTOR` times what that snapshot cost: snapshots then take
about ``1 / COST_FACTOR`` of the run's time at most, whatever the clients and the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
from wafl.common.algorithms import registry
from wafl.common.config import RunConfig
from wafl.common.verified import VerifiedFileError, load_verified, save_verified
from wafl.server.checkpoint import CheckpointError, load_checkpoint
from wafl.server.engine import RoundEngine

log = structlog.get_logger("sim")

FOLDER = "resume"  # in the run folder
STATE = "state.pt"
SITTINGS = "sittings.json"  # each sitting's seconds so far (written after every version)
MAGIC = b"WAFL-SIM-SNAPSHOT-1\n"
COST_FACTOR = 50.0  # by default a snapshot waits for this many times the last one's cost (2 % of the time at most)
SETTLE_POLL_S = 0.002  # how often the pause looks whether every client is done


def not_resumable(cfg: RunConfig) -> str | None:
    """Why an in-process run of ``cfg`` cannot resume exactly from a snapshot (module docstring); None when it can."""
    if cfg.rule.aggregation != "sync":
        return f"aggregation={cfg.rule.aggregation!r}: its versions depend on the order the uploads arrive in"
    if cfg.federation.new_clients:
        return "new_clients: a resumed engine does not send the new clients the model they had still to adapt"
    if (
        cfg.client.protocol != "compute-and-wait"
        and registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict()).personalized
    ):
        return (
            f"protocol={cfg.client.protocol!r}: the PM trains until the next broadcast, so its steps depend on timing"
        )
    return None


class Snapshot:
    """A usable snapshot, as read from ``state.pt`` (module docstring), and how a run takes it back."""

    def __init__(self, out_dir: Path, state: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.state = state
        self.round = int(state["round"])

    def cut_back(self) -> None:
        """Before the engine is built: the results files back to their lengths at the snapshot, and its engine
        checkpoint as the run's ``checkpoint.pt`` (which ``RoundEngine(resume=True)`` restores)."""
        for name, key in (("results.jsonl", "results_bytes"), ("reports.jsonl", "reports_bytes")):
            path = self.out_dir / name
            if path.exists():
                os.truncate(path, int(self.state[key]))
        target = self.out_dir / "checkpoint.pt"
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.copyfile(self.out_dir / FOLDER / self.state["engine"], tmp)
        os.replace(tmp, target)

    def restore_engine(self, engine: RoundEngine) -> None:
        """After the engine was built with ``resume=True``: the results lines still waiting (also to the plateau
        watch, which read the written ones back), the bytes sent since the last line, the run's clock."""
        if not engine.rounds.resumed or engine.strategy.version != self.round + 1:
            raise RuntimeError(f"the engine did not resume from the snapshot of version {self.round}")
        results = json.loads(self.state["results"])
        engine.results.load_state_dict(results)
        plateau = engine.rounds.plateau
        if plateau is not None:
            for _, row, _ in results["pending"]:
                plateau.row(row)  # the GM's values (a watched PM gets its value as the line is written)
        engine.mailbox.bytes_down = int(self.state["bytes_down"])
        engine.rounds.run_start -= float(self.state["wall_s"])  # the lines' wall_s go on from the snapshot's
        engine.results.run_start = engine.rounds.run_start
        log.info("resume.snapshot", round=self.round, run_id=engine.run_id)

    def trainer_state(self, index: int) -> dict[str, Any]:
        """Client ``index``'s trainer, for :meth:`~wafl.client.trainer.Trainer.restore`."""
        return dict(self.state["clients"][index]["trainer"])

    def restore_protocol(self, client: Any) -> None:
        """A client's round protocol (``client_protocol``): the round whose PM it has still to evaluate and
        report, the bytes it uploaded (its final report says)."""
        kept = self.state["clients"][client.trainer.index]
        client.pm_trained_round = kept["pm_trained_round"]
        client.bytes_up = int(kept["bytes_up"])


class Snapshots:
    """A run folder's snapshots: the usable one found there (:attr:`found`), and those the run writes
    (:meth:`pause`). ``every``: versions between two snapshots (0: as the cost allows, module docstring);
    ``tag``: the code's version (a commit), recorded, and warned about when a run resumes under another."""

    def __init__(self, out_dir: Path, cfg: RunConfig, every: int = 0, tag: str = "") -> None:
        reason = not_resumable(cfg)
        if reason is not None:
            raise ValueError(f"a run that cannot resume exactly takes no snapshots: {reason}")
        if every < 0:
            raise ValueError(f"every={every} must be >= 0")
        self.out_dir = out_dir
        self.folder = out_dir / FOLDER
        self.cfg = cfg
        self.every = every
        self.tag = tag
        self.found = self._load()
        self.sittings: list[float] = self._sittings() if self.found is not None else []
        self.started = time.monotonic()
        self.cost_s: float | None = None  # what the last snapshot cost (None: none taken yet)
        self.last = self.started  # when the last snapshot ended

    @property
    def earlier_s(self) -> float:
        """The seconds of the earlier sittings of the run being resumed (each up to its last version's end)."""
        return sum(self.sittings)

    def clear(self) -> None:
        """Removes the folder: the run starts from round 1 (or has ended)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------ reading
    def _load(self) -> Snapshot | None:
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return None
        for name in names:  # what a write killed before its rename left
            if ".tmp" in name:
                (self.folder / name).unlink(missing_ok=True)
        try:
            state = load_verified(self.folder / STATE, MAGIC, "snapshot")
        except VerifiedFileError as e:
            log.warning("resume.unusable", reason=str(e))
            return None
        if state is None:
            return None
        problem = self._problem(state)
        if problem is not None:
            log.warning("resume.unusable", reason=problem)
            return None
        if state.get("tag") != self.tag:
            log.warning("resume.other_code", snapshot=state.get("tag"), now=self.tag)
        return Snapshot(self.out_dir, state)

    def _problem(self, state: Any) -> str | None:
        """Why a snapshot read back cannot be used (None: it can)."""
        keys = ("round", "config", "engine", "results", "results_bytes", "reports_bytes", "bytes_down", "wall_s")
        if not isinstance(state, dict) or any(k not in state for k in (*keys, "clients")):
            return "its entries are missing"
        if state["config"] != self.cfg.to_json():
            return "it was taken by a run of another configuration"
        if not isinstance(state["clients"], list) or len(state["clients"]) != self.cfg.federation.num_clients:
            return f"it does not hold num_clients={self.cfg.federation.num_clients} clients"
        for name, key in (("results.jsonl", "results_bytes"), ("reports.jsonl", "reports_bytes")):
            path = self.out_dir / name
            have = path.stat().st_size if path.exists() else 0
            if have < int(state[key]):
                return f"{name} is shorter ({have} bytes) than when it was taken ({state[key]})"
        try:
            ck = load_checkpoint(self.folder / str(state["engine"]))
        except CheckpointError as e:
            return str(e)
        if ck is None or ck["round"] != state["round"]:
            return f"its engine checkpoint {state['engine']} is missing or of another version"
        return None

    def _sittings(self) -> list[float]:
        try:
            got = json.loads((self.folder / SITTINGS).read_text())["sittings_s"]
            return [float(s) for s in got]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    # ------------------------------------------------------------ writing
    def pause(self, engine: RoundEngine, clients: Sequence[Any]) -> Callable[[], Awaitable[None]]:
        """The round loop's ``between_versions`` (:class:`~wafl.server.rounds.RoundLoop`): records this sitting's
        time, and takes a snapshot when one is due. ``clients``: every client's round protocol
        (``client_protocol``), in index order."""

        async def between_versions() -> None:
            self._record_sitting()
            version = engine.strategy.version - 1  # versions built
            if not engine.strategy.done and self._due(version):
                await self._take(engine, clients, version)

        return between_versions

    def _due(self, version: int) -> bool:
        if self.every:
            return version % self.every == 0
        return self.cost_s is None or time.monotonic() - self.last >= COST_FACTOR * self.cost_s

    def _record_sitting(self) -> None:
        path = self.folder / SITTINGS
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"sittings_s": [*self.sittings, round(time.monotonic() - self.started, 3)]}))
        os.replace(tmp, path)

    async def _take(self, engine: RoundEngine, clients: Sequence[Any], version: int) -> None:
        await _settled(engine, clients)
        began = time.monotonic()
        trainers = await asyncio.gather(*(c.compute.run(c.trainer.snapshot) for c in clients))
        state = {
            "round": version,
            "config": self.cfg.to_json(),
            "tag": self.tag,
            "engine": f"engine-{version}.pt",
            "results": json.dumps(engine.results.state_dict()),
            "bytes_down": engine.mailbox.bytes_down,
            "wall_s": engine.rounds.wall(),
            "clients": [
                {"trainer": t, "pm_trained_round": c.pm_trained_round, "bytes_up": c.bytes_up}
                for c, t in zip(clients, trainers)
            ],
        }
        await asyncio.get_running_loop().run_in_executor(None, self._write, engine, state)
        self.last = time.monotonic()
        self.cost_s = self.last - began
        log.info("snapshot", round=version, seconds=round(self.cost_s, 4))

    def _write(self, engine: RoundEngine, state: dict[str, Any]) -> None:
        """The files of one snapshot, in the order that keeps the last complete one usable (module docstring)."""
        results = engine.results
        state["results_bytes"] = _synced_size(results.results_path)
        state["reports_bytes"] = _synced_size(results.reports_path)
        engine.write_checkpoint(self.folder / state["engine"])
        save_verified(self.folder / STATE, state, MAGIC)
        _sync_folder(self.folder)
        for name in os.listdir(self.folder):
            if name.startswith("engine-") and name.endswith(".pt") and name != state["engine"]:
                (self.folder / name).unlink(missing_ok=True)


async def _settled(engine: RoundEngine, clients: Sequence[Any]) -> None:
    """Returns once every client is done with the newest model it was sent, its uploads and reports sent."""

    def done(c: Any) -> bool:
        d = engine.mailbox.boxes.get(c.session.client_id)
        return (d is None or d.publication.version == c.handled) and not c.uploads and not c.reports

    while not all(done(c) for c in clients):
        await asyncio.sleep(SETTLE_POLL_S)


def _synced_size(path: Path) -> int:
    """The file's length once its bytes are on the disk (0 when there is none)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return 0
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    """Syncs a folder's entries (the renames into it), where the system allows."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
