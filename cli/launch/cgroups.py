"""A CPU share per emulated host: every process of a run in its own control group with a quota.

``wafl run --link-rate`` gives every host its own network namespace and link, but on one
machine they would still share every core, so a client's "idle" time is not idle CPU: another
client uses it. :class:`CpuGroups` gives the server and each client a control group of its own
with a CFS quota (``share`` cores), as if each ran on its own device:

* cgroup v2 (a ``cgroup2`` mount whose ``cgroup.controllers`` lists ``cpu``): ``cpu.max`` =
  ``"quota period"``, used CPU from ``cpu.stat`` (``usage_usec``);
* cgroup v1 (a ``cgroup`` mount with the ``cpu`` controller): ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``, used CPU from ``cpuacct.usage`` (the ``cpuacct`` hierarchy, co-mounted
  or not; without it the used CPU is not measured).

The groups live under the launcher's own group (cgroup v2: beside it, unless it is the root,
since a v2 group with processes cannot hand controllers down), as ``wafl-<pid>-<n>/<host>``
(``server``, ``client0``...); ``wafl-<pid>-<n>`` weighs as much as its hosts would as ordinary
processes (``cpu.shares`` 1024 or ``cpu.weight`` 100 per host) against the machine's other
jobs. A process starts *inside* its group: :meth:`CpuGroups.exec_prefix` is a tiny ``sh``
wrapper that writes its own pid to ``cgroup.procs`` and then execs the command, so no CPU is
spent outside the quota. :meth:`CpuGroups.close` (also run at interpreter exit) kills what is
left in the groups and removes them; groups of launchers that died without cleaning up are
removed the next time groups are created.
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wafl.cli.launch.at_exit import OpenAtExit

__all__ = ["CpuGroups", "CpuQuotaUnavailable", "Hierarchy", "detect", "machine_cpus"]

PERIOD_US = 10_000  # a host that spent its quota waits at most this long (Docker's cpus: uses 100 ms)
MIN_QUOTA_US = 1_000  # the kernel's lower bound for cfs_quota_us / cpu.max
# Writes its own pid into every cgroup.procs file given before "--", then becomes the command.
_WRAPPER = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_counter = itertools.count()


class CpuQuotaUnavailable(RuntimeError):
    """CPU quotas cannot be used here (not root, no cpu controller, read-only control groups)."""

    exit_code: int = 77

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Hierarchy:
    """Where the groups go: ``version`` 1 or 2, the cpu directory and (v1) the cpuacct one."""

    version: int
    cpu: Path  # the directory under which the groups are created (the launcher's own group)
    cpuacct: Path | None = None  # v1 only, when cpuacct is mounted apart from cpu

    def describe(self) -> str:
        extra = f", cpuacct {self.cpuacct}" if self.cpuacct is not None and self.cpuacct != self.cpu else ""
        return f"cgroup v{self.version} at {self.cpu}{extra}"


def machine_cpus() -> float:
    """The cores this process may use: the affinity mask, bounded by the quota of its own group."""
    try:
        n = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        n = float(os.cpu_count() or 1)
    try:
        h = detect()
    except CpuQuotaUnavailable:
        return n
    quota = _read_quota(h.version, h.cpu)
    return min(n, quota) if quota else n


# ----------------------------------------------------------------------------- finding the hierarchy
def _own_path(proc_cgroup: str, controller: str | None) -> str:
    """The launcher's group in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if controller is None and parts[0] == "0" and ctrls == "":
            return path
        if controller is not None and controller in ctrls.split(","):
            return path
    return "/"


def _under(mount: Path, mount_root: str, own: str) -> Path:
    rel = own
    if mount_root not in ("", "/") and (own == mount_root or own.startswith(mount_root.rstrip("/") + "/")):
        rel = own[len(mount_root) :]
    d = mount / rel.lstrip("/")
    return d if d.is_dir() else mount


def detect(root: Path | str | None = None) -> Hierarchy:
    """The cgroup hierarchy with the cpu controller; :class:`CpuQuotaUnavailable` when there is none.

    ``root`` (or ``WAFL_CGROUP_ROOT``): a folder standing for ``/sys/fs/cgroup`` (tests): v2 when
    it holds ``cgroup.controllers``, else v1 with ``cpu/`` and ``cpuacct/`` in it.
    """
    root = root if root is not None else os.environ.get("WAFL_CGROUP_ROOT")
    if root is not None:
        return _detect_at(Path(root))
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError as e:
        raise CpuQuotaUnavailable(f"CPU quotas unavailable: cannot read the control group mounts ({e})") from None
    v1: dict[str, tuple[Path, str]] = {}
    v2: list[tuple[Path, str]] = []
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, point = fields[3], Path(fields[4].replace("\\040", " "))
        if tail[0] == "cgroup2":
            v2.append((point, mount_root))
        elif tail[0] == "cgroup":
            for opt in tail[2].split(","):
                if opt in ("cpu", "cpuacct"):
                    v1.setdefault(opt, (point, mount_root))
    for point, mount_root in v2:
        try:
            controllers = (point / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in controllers:
            own = _under(point, mount_root, _own_path(proc_cgroup, None))
            # A v2 group holding processes (this one) cannot hand controllers to children, the
            # root excepted: the run's groups become siblings of the launcher's own group.
            return Hierarchy(2, own if own == point else own.parent)
    if "cpu" in v1:
        point, mount_root = v1["cpu"]
        cpu = _under(point, mount_root, _own_path(proc_cgroup, "cpu"))
        acct = None
        if "cpuacct" in v1:
            apoint, aroot = v1["cpuacct"]
            acct = _under(apoint, aroot, _own_path(proc_cgroup, "cpuacct"))
        return Hierarchy(1, cpu, acct)
    raise CpuQuotaUnavailable(
        "CPU quotas unavailable: no control group hierarchy with the cpu controller is mounted "
        "(cgroup v2 without cpu in cgroup.controllers, no v1 cpu mount); use --host-cpus none"
    )


def _detect_at(root: Path) -> Hierarchy:
    if (root / "cgroup.controllers").is_file():
        try:
            controllers = (root / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        if "cpu" in controllers:
            return Hierarchy(2, root)
        raise CpuQuotaUnavailable(
            f"CPU quotas unavailable: the cpu controller is not enabled at {root} "
            "(cgroup.controllers lacks cpu); use --host-cpus none"
        )
    if (root / "cpu" / "cpu.cfs_quota_us").is_file():
        acct = root / "cpuacct"
        return Hierarchy(1, root / "cpu", acct if (acct / "cpuacct.usage").is_file() else None)
    raise CpuQuotaUnavailable(
        f"CPU quotas unavailable: no cpu controller under {root} (neither cgroup v2 with cpu nor a v1 cpu "
        "hierarchy); use --host-cpus none"
    )


def _read_quota(version: int, d: Path) -> float | None:
    """Cores allowed by the quota of group ``d`` (None: unlimited or unreadable)."""
    try:
        if version == 2:
            quota, _, period = (d / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or PERIOD_US)
        quota_us = int((d / "cpu.cfs_quota_us").read_text())
        if quota_us <= 0:
            return None
        return quota_us / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- the groups of one run
_open: OpenAtExit[CpuGroups] = OpenAtExit("control groups")


class CpuGroups:
    """One control group per host (``server``, ``client0``...), each held to ``shares[host]`` cores.

    ``shares`` maps host names to cores (e.g. 0.4), each enforced as ``share * period_us`` of
    CPU time per ``period_us``. The default period is 10 ms, lengthened where the smallest share
    would fall below the kernel's minimum quota (1 ms); ``WAFL_CPU_PERIOD_US`` or ``period_us``
    sets it. A host that spent its quota waits for the next period: with Docker's 100 ms, a
    wait-free PM that spent its client's quota while the client's upload waited on the network
    delays the next GM phase by up to 60 ms at 0.4 cores (measured: 20 % longer GM phases, round
    speedup 0.94 of the ideal; at 10 ms, 1.03; ``benchmarks/results/protocols/``). Raises
    :class:`CpuQuotaUnavailable` (one line) when the hierarchy is missing or not writable.
    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, shares: Mapping[str, float], root: Path | str | None = None, period_us: int | None = None):
        self.hierarchy = detect(root)
        self.shares = {h: float(s) for h, s in shares.items()}
        smallest = min((s for s in self.shares.values() if s > 0), default=1.0)
        fitting = min(1_000_000, max(PERIOD_US, math.ceil(MIN_QUOTA_US / smallest)))
        self.period_us = int(period_us or os.environ.get("WAFL_CPU_PERIOD_US") or fitting)
        if not 1_000 <= self.period_us <= 1_000_000:
            raise ValueError(f"CPU quota period {self.period_us} us is outside [1000, 1000000]")
        for host, s in self.shares.items():
            if not s * self.period_us >= MIN_QUOTA_US:
                raise ValueError(f"host {host}: a share of {s:g} cores is below the kernel's minimum quota")
        self._lock = threading.Lock()
        self._closed = False
        self._created: list[Path] = []
        self._started: dict[str, float] = {}
        self._stopped: dict[str, float] = {}
        self._final: dict[str, dict[str, Any]] = {}
        self.name = f"wafl-{os.getpid()}-{next(_counter)}"
        _sweep_stale(self._bases())
        try:
            self._build()
        except PermissionError as e:
            self.close()
            uid = os.geteuid()
            need = "root" if uid != 0 else "a writable control group hierarchy"
            raise CpuQuotaUnavailable(
                f"CPU quotas unavailable: cannot create control groups under {self.hierarchy.cpu} ({e.strerror}; "
                f"needs {need}, running as uid {uid}); rerun with sudo or use --host-cpus none"
            ) from None
        except OSError as e:
            self.close()
            raise CpuQuotaUnavailable(
                f"CPU quotas unavailable: setting up control groups under {self.hierarchy.cpu} failed: {e}; "
                "use --host-cpus none"
            ) from None
        _open.add(self)

    # -- layout -------------------------------------------------------------------------------
    def _bases(self) -> list[Path]:
        h = self.hierarchy
        return [h.cpu] + ([h.cpuacct] if h.cpuacct is not None and h.cpuacct != h.cpu else [])

    def group(self, host: str, base: Path | None = None) -> Path:
        """The directory of ``host``'s group (in the cpu hierarchy unless ``base`` is given)."""
        if host not in self.shares:
            raise ValueError(f"unknown host {host!r}: expected one of {sorted(self.shares)}")
        return (base or self.hierarchy.cpu) / self.name / host

    def _mkdir(self, d: Path) -> None:
        d.mkdir()
        self._created.append(d)

    def _build(self) -> None:
        h = self.hierarchy
        for base in self._bases():
            self._mkdir(base / self.name)
        if h.version == 2:
            _enable_cpu(h.cpu)
            _enable_cpu(h.cpu / self.name)
        # The run's group weighs as much as its hosts would as ordinary processes (one group would
        # otherwise weigh as one process against the other jobs of the machine).
        n = len(self.shares)
        if h.version == 2:
            _write_optional(h.cpu / self.name / "cpu.weight", str(min(10_000, 100 * n)))
        else:
            _write_optional(h.cpu / self.name / "cpu.shares", str(min(262_144, 1024 * n)))
        for host, share in self.shares.items():
            for base in self._bases():
                self._mkdir(base / self.name / host)
            d = self.group(host)
            quota = max(MIN_QUOTA_US, round(share * self.period_us))
            if h.version == 2:
                (d / "cpu.max").write_text(f"{quota} {self.period_us}\n")
            else:
                (d / "cpu.cfs_period_us").write_text(f"{self.period_us}\n")
                (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    # -- starting processes ---------------------------------------------------------------------
    def exec_prefix(self, host: str) -> list[str]:
        """Argv prefix: the command runs inside ``host``'s group(s) from its first instruction."""
        procs = [str(self.group(host, base) / "cgroup.procs") for base in self._bases()]
        self._started.setdefault(host, time.monotonic())
        return ["sh", "-c", _WRAPPER, "wafl-cgexec", *procs, "--"]

    def mark_stopped(self, host: str) -> None:
        """Records the end of ``host``'s process (for the measured CPU fraction)."""
        self._stopped.setdefault(host, time.monotonic())

    # -- reading back -------------------------------------------------------------------------
    def quota(self, host: str) -> tuple[int | None, int]:
        """``(quota_us, period_us)`` as read back from ``host``'s group (quota None: unlimited)."""
        d = self.group(host)
        if self.hierarchy.version == 2:
            q, _, p = (d / "cpu.max").read_text().strip().partition(" ")
            return (None if q == "max" else int(q)), int(p or self.period_us)
        quota = int((d / "cpu.cfs_quota_us").read_text())
        return (None if quota < 0 else quota), int((d / "cpu.cfs_period_us").read_text())

    def usage(self, host: str) -> dict[str, float | None]:
        """CPU seconds used by ``host``'s group so far, with throttling counts where the kernel gives them."""
        h = self.hierarchy
        d = self.group(host)
        out: dict[str, float | None] = {"cpu_s": None, "nr_periods": None, "nr_throttled": None, "throttled_s": None}
        stat = _kv(d / "cpu.stat")
        if h.version == 2:
            if "usage_usec" in stat:
                out["cpu_s"] = stat["usage_usec"] / 1e6
            if "throttled_usec" in stat:
                out["throttled_s"] = stat["throttled_usec"] / 1e6
        else:
            if h.cpuacct is not None:
                try:
                    out["cpu_s"] = int((self.group(host, h.cpuacct) / "cpuacct.usage").read_text()) / 1e9
                except (OSError, ValueError):
                    pass
            if "throttled_time" in stat:
                out["throttled_s"] = stat["throttled_time"] / 1e9
        for k in ("nr_periods", "nr_throttled"):
            if k in stat:
                out[k] = stat[k]
        return out

    def report(self) -> dict[str, Any]:
        """Per host: the share asked for, the quota read back, the CPU used and its fraction of the wall time."""
        hosts: dict[str, Any] = {}
        for host, share in self.shares.items():
            if host in self._final:
                hosts[host] = self._final[host]
                continue
            try:
                quota_us, period_us = self.quota(host)
                used = self.usage(host)
            except OSError:
                continue
            start = self._started.get(host)
            end = self._stopped.get(host, time.monotonic())
            wall = end - start if start is not None else None
            cpu_s = used["cpu_s"]
            hosts[host] = {
                "share": round(share, 4),
                "quota_us": quota_us,
                "period_us": period_us,
                "quota_cpus": round(quota_us / period_us, 4) if quota_us else None,
                "cpu_s": None if cpu_s is None else round(cpu_s, 3),
                "wall_s": None if wall is None else round(wall, 3),
                "cpu_fraction": round(cpu_s / wall, 4) if cpu_s is not None and wall else None,
                "nr_periods": used["nr_periods"],
                "nr_throttled": used["nr_throttled"],
                "throttled_s": None if used["throttled_s"] is None else round(used["throttled_s"], 3),
                "group": str(self.group(host)),
            }
        return {"cgroup_version": self.hierarchy.version, "hierarchy": self.hierarchy.describe(), "hosts": hosts}

    # -- teardown -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Kills whatever is still inside the groups and removes them (idempotent)."""
        with self._lock:
            if self._closed:
                return
            if self._created:
                try:
                    rep = self.report()["hosts"]
                    self._final.update(rep)
                except Exception:  # noqa: BLE001 - the numbers are a by-product of cleanup
                    pass
            self._closed = True
            leaves = [d for d in self._created if d.parent.name == self.name]
            for d in leaves:
                _empty(d)
            for d in reversed(self._created):
                _rmdir(d)
            self._created.clear()
        _open.discard(self)

    def __enter__(self) -> CpuGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CpuGroups({self.name}, {self.hierarchy.describe()}, shares={self.shares})"


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            try:
                out[k] = int(v)
            except ValueError:
                pass
    except OSError:
        pass
    return out


def _write_optional(path: Path, value: str) -> None:
    try:
        path.write_text(value + "\n")
    except OSError:
        pass


def _enable_cpu(d: Path) -> None:
    """cgroup v2: lets the children of ``d`` have the cpu controller (``+cpu`` in its subtree_control)."""
    control = d / "cgroup.subtree_control"
    try:
        if "cpu" in control.read_text().split():
            return
    except OSError:
        pass
    try:
        control.write_text("+cpu\n")
    except OSError as e:
        raise OSError(
            e.errno,
            f"cannot enable the cpu controller for the children of {d} ({e.strerror}); a v2 group that holds "
            "processes cannot hand controllers down: start wafl from a leaf group of its own",
        ) from None


def _pids(d: Path) -> list[int]:
    try:
        return [int(p) for p in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _empty(d: Path, timeout_s: float = 5.0) -> None:
    """SIGKILLs the processes still in group ``d`` (started into it by this run) and waits for them to leave."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _pids(d)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _rmdir(d: Path, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if not d.exists():
                return
            if _is_fake(d):  # a plain folder standing for a hierarchy (tests): remove its files too
                for f in d.iterdir():
                    if f.is_file():
                        f.unlink()
                try:
                    d.rmdir()
                except OSError:
                    pass
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


def _is_fake(d: Path) -> bool:
    try:
        return _fs_type(d) not in ("cgroup", "cgroup2")
    except OSError:
        return False


def _fs_type(d: Path) -> str:
    """The file system type of the mount holding ``d`` (from /proc/self/mountinfo)."""
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    p = str(d.resolve())
    for line in lines:
        pre, sep, post = line.partition(" - ")
        fields = pre.split()
        if not sep or len(fields) < 5:
            continue
        point = fields[4]
        if (p == point or p.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, post.split()[0]
    return kind


def _sweep_stale(bases: Sequence[Path]) -> None:
    """Removes ``wafl-<pid>-<n>`` groups left by launchers that no longer exist (and hold no process)."""
    for base in bases:
        try:
            entries = list(base.glob("wafl-*-*"))
        except OSError:
            continue
        for parent in entries:
            parts = parent.name.split("-")
            if len(parts) != 3 or not parts[1].isdigit() or not parent.is_dir():
                continue
            pid = int(parts[1])
            if pid == os.getpid() or Path(f"/proc/{pid}").exists():
                continue
            children = [c for c in parent.iterdir() if c.is_dir()]
            if any(_pids(c) for c in children) or _pids(parent):
                continue
            for c in children:
                _rmdir(c, timeout_s=0.5)
            _rmdir(parent, timeout_s=0.5)
