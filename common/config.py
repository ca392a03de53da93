"""Run configuration: typed sections, validated once at the edge, every error naming its field.

Sources, later ones winning: defaults, a TOML or JSON file (``--config``), command-line
overrides. The server resolves it and hands it to every client in ``JoinReply.config_json``,
so clients need only the server's address and their index.

A :class:`RunConfig` is made of sections, one dataclass each, and every field is read through its
section (``cfg.training.lr``, ``cfg.data.partition``):

==============  =================================================================================
section         fields
==============  =================================================================================
``data``        :class:`DataSection`: the dataset and how it is split among the clients
``federation``  :class:`FederationSection`: the clients, rounds, selection, deadlines, time-outs,
                memory for rollbacks, the seed, and the clients' heterogeneity (slow-down, drop-out)
``rule``        :class:`RuleSection`: the aggregation rule (``aggregation``: sync, buffered,
                fedasync) and the settings the rules read (``concurrency``, ``staleness``, ...)
``security``    :class:`SecuritySection`: how uploads combine (``aggregator``) and the bound on any
                one client's influence (``clip_norm``, ``norm_bound``)
``training``    :class:`TrainingSection`: the model, the algorithm and its ``params``, the local
                optimizer and the device
``client``      :class:`ClientSection`: the client protocol (``protocol``) and its personalized
                model's share of the client's time (``pm_epochs``, ``pm_nice``, ...)
``evaluation``  :class:`EvaluationSection`: when and how models are evaluated, the plateau rule
``output``      :class:`OutputSection`: checkpoints and TensorBoard
==============  =================================================================================

No field name is used twice and no section is named as a field (``protocol`` and ``aggregation`` are
fields, so their sections are ``client`` and ``rule``), so a flat key names one field of one section.
Files, flags, ``--set FIELD=VALUE``, sweeps and ``config.json`` keep the flat keys they always had:
:data:`SECTION_OF` maps each field to its section, built from the sections' dataclasses. A mapping may
also give a section as a table of its fields (``[training]`` then ``lr = 0.1`` in TOML,
``{"training": {"lr": 0.1}}`` in JSON) or a field as ``section.field`` (:func:`flat_fields`).
:meth:`RunConfig.to_dict` and :meth:`RunConfig.to_json` write the flat mapping (``config.json``, the run
mapping the algorithms are built with), which :meth:`RunConfig.from_mapping` reads back.

A field with a closed set of values holds a member of its :class:`enum.StrEnum`
(:mod:`wafl.common.choices`, :class:`~wafl.common.contract.ClientProtocol`), which is its string:
:meth:`RunConfig.validate` converts the strings of a file, a flag or a constructor once. Validation is
explicit and depends on nothing imported before it: each section's ``validate`` checks its own fields and
:meth:`RunConfig.validate` runs them, then the checks that span sections (the algorithm and its parameters
against the whole run, the plateau rule against ``rounds`` and the algorithm). The aggregation rule's
section (``rule``) and the ``aggregator`` (a robust center the server registers) are checked by whoever runs
the rules, ``wafl.server.strategies.check_aggregation``, which the command line, the sweep loader, the server
and an in-process run call.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from wafl.common.choices import DeviceKind, Optimizer, Partition, PlateauMetric
from wafl.common.contract import ClientProtocol

E = TypeVar("E", bound=enum.StrEnum)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the value."""


@dataclass
class DataSection:
    """The dataset and its split among the clients (:mod:`wafl.common.partition`)."""

    dataset: str = "digits"
    data_dir: str | None = None
    partition: Partition = Partition.DIRICHLET
    alpha: float = 0.5  # per-class Dirichlet concentration
    delta: float = 0.3  # class-prior concentration of the equal-size Dirichlet split
    client_size: int | None = None  # dirichlet-equal: samples per client (None: the train split shared out)
    local_test_fraction: float = 0.25

    def validate(self) -> None:
        from wafl.common.datasets import DATASETS

        _one_of("dataset", self.dataset, sorted(DATASETS))
        self.partition = _choice("partition", self.partition, Partition)
        _positive("alpha", self.alpha)
        _positive("delta", self.delta)
        if self.client_size is not None:
            _int_at_least("client_size", self.client_size, 1)
            if self.partition != Partition.DIRICHLET_EQUAL:
                raise ConfigError(f"client_size={self.client_size} needs partition='dirichlet-equal'")
        _in_range("local_test_fraction", self.local_test_fraction, 0.0, 1.0, low_open=True)


@dataclass
class FederationSection:
    """Who takes part and when: the clients, the rounds, selection, deadlines and time-outs, the memory
    uploads in flight keep for their rollback, the seed, and the clients' heterogeneity (reproducible from
    the seed)."""

    num_clients: int = 10
    rounds: int = 25
    fraction: float = 1.0  # share of clients selected per round
    act_prob: float | None = None  # independent per-client activation probability (replaces fraction)
    # clients held out of training (drawn from the seed; wafl.common.heterogeneity): at each evaluation they
    # adapt the global model for new_client_epochs epochs and report new_client_accuracy
    new_clients: int = 0
    new_client_epochs: int = 1
    min_clients: int | None = None  # uploads needed to close a round once the deadline passed
    # sync: also send each model to the clients that do nothing with it (not selected, no personal
    # phase on it); by default they get only the models they train on and the final one
    broadcast_all: bool = False
    round_deadline_s: float = 120.0
    join_timeout_s: float = 300.0
    upload_stall_s: float = 30.0  # an upload stream without a message for this long is cut off and rolled back
    # received chunks that uploads in flight keep in memory for their rollback (beyond: a spill file)
    rollback_memory_mb: float = 256.0
    # of which one upload keeps at most this much (a large model's upload spills the rest)
    rollback_upload_mb: float = 2.0
    # the wait for final reports ends this long after the last final model sent or final report received
    final_report_s: float = 30.0
    max_round_retries: int = 3
    seed: int = 0
    slowdown: str = "none"  # compute slow-down per client: none, "1,2,4,...", lognormal:sigma=S
    dropout: float = 0.0  # probability that a client asked to train goes offline until the next model

    def validate(self) -> None:
        _int_at_least("num_clients", self.num_clients, 1)
        _int_at_least("new_clients", self.new_clients, 0)
        if self.new_clients >= self.num_clients:
            raise ConfigError(
                f"new_clients={self.new_clients} must be less than num_clients={self.num_clients}: "
                "at least one client must train"
            )
        _int_at_least("new_client_epochs", self.new_client_epochs, 0)
        _int_at_least("rounds", self.rounds, 1)
        _in_range("fraction", self.fraction, 0.0, 1.0, low_open=True)
        if self.act_prob is not None:
            _in_range("act_prob", self.act_prob, 0.0, 1.0, low_open=True)
        if self.min_clients is not None:
            _int_at_least("min_clients", self.min_clients, 1)
            if self.min_clients > self.training_clients:
                raise ConfigError(f"min_clients={self.min_clients} is more than {self.training_clients_text}")
        _positive("round_deadline_s", self.round_deadline_s)
        _positive("join_timeout_s", self.join_timeout_s)
        _positive("upload_stall_s", self.upload_stall_s)
        _positive("final_report_s", self.final_report_s)
        for name, value in (
            ("rollback_memory_mb", self.rollback_memory_mb),
            ("rollback_upload_mb", self.rollback_upload_mb),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0 (got {value!r})")
        _int_at_least("max_round_retries", self.max_round_retries, 0)
        _int_at_least("seed", self.seed, 0)
        try:
            from wafl.common.heterogeneity import slowdowns

            slowdowns(self.slowdown, self.num_clients, self.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _in_range("dropout", self.dropout, 0.0, 1.0, high_open=True)

    @property
    def training_clients(self) -> int:
        """The clients that train: ``num_clients`` less the ``new_clients`` held out (selection,
        ``fraction``, ``min_clients`` and ``concurrency`` count these only)."""
        return self.num_clients - self.new_clients

    @property
    def training_clients_text(self) -> str:
        """:attr:`training_clients` as an error message names it."""
        if not self.new_clients:
            return f"num_clients={self.num_clients}"
        n, k = self.num_clients, self.new_clients
        return f"the {self.training_clients} training clients (num_clients={n} - new_clients={k})"


@dataclass
class RuleSection:
    """The aggregation rule (``server/strategies/``): sync (lock-step rounds), buffered (FedBuff), fedasync
    (FedAsync), and the settings the rules read. Nothing here checks them: the rules do
    (``wafl.server.strategies.check_aggregation``; the module docstring)."""

    aggregation: str = "sync"
    aggregation_params: dict[str, Any] = field(default_factory=dict)  # the rule's own settings (fedasync: alpha)
    concurrency: int | None = None  # buffered, fedasync: clients training at once (None: every client)
    buffer_size: int | None = None  # buffered: accepted updates per new version (None: half the concurrency)
    staleness: str = "sqrt"  # buffered, fedasync: weight by age in versions: sqrt 1/sqrt(1+s), poly, hinge, constant
    staleness_a: float = 0.5  # poly: (1+s)^-a; hinge: 1/(a(s-b)+1) beyond b
    staleness_b: int = 4  # hinge: the age up to which updates count fully
    max_staleness: int = 20  # buffered, fedasync: older updates are refused
    server_lr: float = 1.0  # buffered: step size of the averaged update


@dataclass
class SecuritySection:
    """Bounded influence of any one client: how uploads combine and how far one update may reach."""

    # mean (weighted) or a robust center (server/aggregation/robust.py: trimmed_mean, median)
    aggregator: str = "mean"
    trim_fraction: float = 0.1  # trimmed_mean: share of the values dropped at each end of every coordinate
    clip_norm: float | None = None  # L2 bound on each upload's update (difference to the model it trained from)
    # without clip_norm: each update is clipped to this multiple of the median norm of the updates accepted in
    # the last rounds (in the first, of the global model's norm); 0: no bound (server/aggregation/norm_bound.py)
    norm_bound: float = 10.0

    def validate(self) -> None:
        """The numeric fields. The ``aggregator``'s name (a robust center registered by the server), and
        whether a robust aggregator has enough uploads per aggregation, depend on the server's plug-ins:
        ``wafl.server.strategies.check_aggregation`` checks them."""
        _in_range("trim_fraction", self.trim_fraction, 0.0, 0.5, high_open=True)
        if self.clip_norm is not None:
            _positive("clip_norm", self.clip_norm)
        if not (math.isfinite(self.norm_bound) and (self.norm_bound == 0 or self.norm_bound >= 1)):
            raise ConfigError(f"norm_bound must be 0 (off) or a finite multiple >= 1 (got {self.norm_bound})")


@dataclass
class TrainingSection:
    """The model, the algorithm and its parameters, and local training."""

    model: str = "cnn"
    code_len: int = 32
    algorithm: str = "fedavg"
    params: dict[str, Any] = field(default_factory=dict)  # algorithm hyper-parameters
    optimizer: Optimizer = Optimizer.SGD
    lr: float = 0.05
    # the clients' learning rate in round t is lr * lr_decay ** (t - 1) (common/training.py decay_lr); 1: constant.
    # The code of FedDyn and of the methods built on it (ASD's) decays it by 0.998 a round.
    lr_decay: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 0.0
    # > 0: every local step's gradient is scaled to an L2 norm of at most this before the optimizer steps
    # (common/training.py clip_before_step); 0: off. ASD's code clips every method's steps at 10.
    grad_clip: float = 0.0
    batch_size: int = 32
    local_epochs: int = 2  # E_G
    device: str = DeviceKind.AUTO.value  # auto, cpu, cuda or cuda:N (DeviceKind)

    def validate(self) -> None:
        """Every field but ``algorithm`` and ``params``, which :meth:`RunConfig.validate` resolves against the
        whole run."""
        from wafl.common.models import MODELS

        _one_of("model", self.model, sorted(MODELS))
        self.optimizer = _choice("optimizer", self.optimizer, Optimizer)
        _int_at_least("code_len", self.code_len, 1)
        _positive("lr", self.lr)
        _in_range("lr_decay", self.lr_decay, 0.0, 1.0, low_open=True)
        _in_range("momentum", self.momentum, 0.0, 1.0, high_open=True)
        _in_range("weight_decay", self.weight_decay, 0.0, math.inf)
        _in_range("grad_clip", self.grad_clip, 0.0, math.inf)
        _int_at_least("batch_size", self.batch_size, 1)
        _int_at_least("local_epochs", self.local_epochs, 1)
        _check_device(self.device)


@dataclass
class ClientSection:
    """The client protocol and the personalized model's (PM) share of a client's time."""

    protocol: ClientProtocol = ClientProtocol.WAIT_FREE
    pm_epochs: int = 1  # E_P (compute-and-wait)
    pm_min_steps: int = 0
    pm_max_epochs: float | None = None
    pm_nice: int = 19  # wait-free PM thread's nice value: it only fills time the federation would idle
    pm_yield_transfers: bool = False  # wait-free PM: not during the client's own upload and download

    def validate(self) -> None:
        self.protocol = _choice("protocol", self.protocol, ClientProtocol)
        _int_at_least("pm_epochs", self.pm_epochs, 0)
        _int_at_least("pm_min_steps", self.pm_min_steps, 0)
        if self.pm_max_epochs is not None:
            _positive("pm_max_epochs", self.pm_max_epochs)
        if not isinstance(self.pm_nice, int) or isinstance(self.pm_nice, bool) or not 0 <= self.pm_nice <= 19:
            raise ConfigError(
                f"pm_nice={self.pm_nice!r} must be an integer in [0, 19] (0: the PM thread runs at normal priority)"
            )
        if not isinstance(self.pm_yield_transfers, bool):
            raise ConfigError(f"pm_yield_transfers={self.pm_yield_transfers!r} must be true or false")


@dataclass
class EvaluationSection:
    """When models are evaluated, and the plateau rule that ends a run early (:mod:`wafl.common.plateau`)."""

    eval_batch_size: int = 256
    # evaluate every N rounds (0: only after the last): the global model, and under sync the clients'
    # local and personal models (RunConfig.evaluates)
    eval_every: int = 1
    # stop once the watched accuracy flattened (wafl.common.plateau): its mean over the last plateau_window
    # rounds lies within plateau_delta points of the window before; rounds stays the maximum (0: never)
    plateau_window: int = 0
    plateau_delta: float = 0.3
    plateau_z: float = 0.0  # > 0: |gap| plus plateau_z standard errors within plateau_delta (1.645: a 95 % bound)
    # auto (the GM where it is evaluated and the PM where the method has one: stop once each flattened),
    # gm_accuracy, pm_accuracy
    plateau_metric: PlateauMetric = PlateauMetric.AUTO
    # every N rounds (0: never) record the clients' gradient dissimilarity G_d at the global model (in process only)
    grad_dissimilarity_every: int = 0

    def validate(self) -> None:
        """Every field, and the plateau rule's windows against ``eval_every``; against ``rounds`` and the
        algorithm, :meth:`RunConfig.validate`."""
        _int_at_least("eval_batch_size", self.eval_batch_size, 1)
        _int_at_least("eval_every", self.eval_every, 0)
        _int_at_least("grad_dissimilarity_every", self.grad_dissimilarity_every, 0)
        _int_at_least("plateau_window", self.plateau_window, 0)
        _in_range("plateau_delta", self.plateau_delta, 0.0, 100.0)
        self.plateau_metric = _choice("plateau_metric", self.plateau_metric, PlateauMetric)
        _in_range("plateau_z", self.plateau_z, 0.0, 10.0)
        w = self.plateau_window
        if not w:
            return
        if not 1 <= self.eval_every <= w:
            raise ConfigError(
                f"plateau_window={w} with eval_every={self.eval_every}: every window of rounds must hold an "
                "evaluated round, so eval_every must lie in 1..plateau_window"
            )
        if self.plateau_z and 2 * self.eval_every > w:
            raise ConfigError(
                f"plateau_z={self.plateau_z:g} with plateau_window={w} and eval_every={self.eval_every}: the "
                "standard error needs two evaluated rounds in each window, so eval_every must lie in "
                "1..plateau_window // 2"
            )


@dataclass
class OutputSection:
    """What a run keeps beside its results: checkpoints and TensorBoard event files."""

    checkpoint: bool = True
    keep_checkpoint_every: int = 0  # also keep every N-th round's checkpoint as checkpoints/round-N.pt (0: none)
    tensorboard: str | None = None  # folder for TensorBoard event files (the server writes them)

    def validate(self) -> None:
        _int_at_least("keep_checkpoint_every", self.keep_checkpoint_every, 0)
        if self.keep_checkpoint_every and not self.checkpoint:
            raise ConfigError(f"keep_checkpoint_every={self.keep_checkpoint_every} needs checkpoint = true")


@dataclass
class RunConfig:
    """A run's configuration: its sections (the module docstring), each field read through its section."""

    data: DataSection = field(default_factory=DataSection)
    federation: FederationSection = field(default_factory=FederationSection)
    rule: RuleSection = field(default_factory=RuleSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    training: TrainingSection = field(default_factory=TrainingSection)
    client: ClientSection = field(default_factory=ClientSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    output: OutputSection = field(default_factory=OutputSection)

    def validate(self) -> RunConfig:
        """Checks every field this package knows, section by section, then what spans sections, each
        closed-set field's string becoming its member; returns self. Raises :class:`ConfigError` naming the
        first bad one. The aggregation rule's fields are not among them (the module docstring): a client
        validates only what it owns, on a configuration its server has checked."""
        from wafl.common.algorithms import registry

        self.data.validate()
        self.federation.validate()
        # self.rule: checked by the rules themselves (check_aggregation; the module docstring)
        self.security.validate()
        self.training.validate()
        self.client.validate()
        self.evaluation.validate()
        self.output.validate()
        try:
            algorithm = registry.resolve(self.training.algorithm, self.training.params, self.to_dict())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.training.params = algorithm.params
        self._validate_plateau(algorithm)
        return self

    def _validate_plateau(self, algorithm: Any) -> None:
        """The plateau rule (``wafl.common.plateau``) against ``rounds`` and the run's resolved algorithm."""
        from wafl.common.plateau import GM, PM, watched_metrics

        ev = self.evaluation
        w = ev.plateau_window
        if not w:
            return
        if self.federation.rounds < 2 * w:
            raise ConfigError(
                f"plateau_window={w} with rounds={self.federation.rounds}: the rule compares two windows of "
                f"rounds, so rounds must be at least 2 * plateau_window = {2 * w}"
            )
        watched = watched_metrics(ev.plateau_metric, algorithm)
        name = self.training.algorithm
        if PM in watched and algorithm.personal == "none":
            raise ConfigError(
                f"plateau_metric={ev.plateau_metric!r} with algorithm={name!r}: it has no personalized model to watch"
            )
        if GM in watched and not algorithm.evaluates_global:
            raise ConfigError(
                f"plateau_metric={ev.plateau_metric!r} with algorithm={name!r}: its global model is not "
                "evaluated (gm_accuracy is empty); watch pm_accuracy"
            )
        if not watched:
            raise ConfigError(
                f"plateau_metric={ev.plateau_metric!r} with algorithm={name!r}: it evaluates neither a global nor "
                "a personalized model, so the plateau rule has nothing to watch"
            )

    def evaluates(self, round: int) -> bool:
        """Whether the model of ``round`` (a version under asynchronous aggregation) is evaluated: every
        ``eval_every`` rounds, and the last; with the plateau rule (``plateau_window``), every one of the
        last ``2 * plateau_window`` rounds before the maximum too."""
        rounds, ev = self.federation.rounds, self.evaluation
        if round == rounds or bool(ev.eval_every and round % ev.eval_every == 0):
            return True
        return bool(ev.plateau_window) and round > rounds - 2 * ev.plateau_window

    def evaluates_locally(self, round: int, lock_step: bool) -> bool:
        """Whether the clients that train in ``round`` evaluate their models on their local test sets
        (the upload's local or personal accuracy, the personal model's report). ``lock_step``: whether the
        run's aggregation rule runs lock-step rounds, every client of a round on one version, as the rule
        declares it (the server's ``Strategy.lock_step``; a client reads it from every broadcast header,
        ``BroadcastHeader.asynchronous``). Lock-step, with the global model (:meth:`evaluates`): a round's
        line has all its accuracies or none. Otherwise every time, since an upload's round is not its line's."""
        return not lock_step or self.evaluates(round)

    def to_dict(self) -> dict[str, Any]:
        """Every field as a plain value (a closed-set field as its string), flat, section after section in
        their order: what ``config.json`` holds, and the run mapping the algorithms are built with."""
        return {
            k: v.value if isinstance(v, enum.Enum) else v
            for s in dataclasses.fields(self)
            for k, v in dataclasses.asdict(getattr(self, s.name)).items()
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_mapping(data: Mapping[str, Any]) -> RunConfig:
        """The configuration of ``data``'s fields over the defaults, unvalidated: flat fields
        (``{"lr": 0.1}``, what :meth:`to_dict` writes), sections (``{"training": {"lr": 0.1}}``) or
        ``section.field`` keys, in any mix (:func:`flat_fields`). Each value must have its field's type."""
        cfg = RunConfig()
        for k, v in flat_fields(data).items():
            setattr(getattr(cfg, SECTION_OF[k]), k, _coerce(k, v))
        return cfg

    @staticmethod
    def from_json(text: str) -> RunConfig:
        return RunConfig.from_mapping(json.loads(text))


# The sections of RunConfig (name -> dataclass), and every field's section (field name -> section name): the
# one table that maps the flat keys of files, flags and config.json to the sections, built from the dataclasses.
SECTIONS: dict[str, type[Any]] = {
    f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
}
SECTION_OF: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
if len(SECTION_OF) != len(_FIELDS) or len(_FIELDS) != sum(len(dataclasses.fields(c)) for c in SECTIONS.values()):
    raise TypeError("RunConfig: a field name is used in two sections")  # a flat key must name one field
if set(SECTIONS) & set(SECTION_OF):
    raise TypeError(f"RunConfig: a section is named as a field: {sorted(set(SECTIONS) & set(SECTION_OF))}")


def flat_fields(data: Mapping[str, Any], check: bool = True) -> dict[str, Any]:
    """``data`` with every field under its flat name, in order: a flat key (``lr``) as it is, a section's table
    (``training = {lr = 0.1}``) spread into its fields, a ``section.field`` key (``training.lr``) as its field.
    A field given twice is refused. Any other key is refused too (a flat one naming every field, as files always
    were), or, with ``check`` false, kept as it is (a section's entry as ``section.name``) for a later check to
    name: a sweep merges its files' fields before each point is checked."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the key it came from

    def put(name: str, key: str, value: Any) -> None:
        if name in given:
            raise ConfigError(f"{name} is given twice ({given[name]} and {key})")
        given[name], out[name] = key, value

    unknown: list[str] = []
    for key, value in data.items():
        section, dot, name = key.partition(".")
        if key in SECTION_OF:
            put(key, key, value)
        elif key in SECTIONS and isinstance(value, Mapping):
            for k, v in value.items():
                if SECTION_OF.get(k) == key:
                    put(k, f"{key}.{k}", v)
                elif check:
                    _not_in_section(key, k)
                else:
                    out[f"{key}.{k}"] = v
        elif dot and SECTION_OF.get(name) == section:
            put(name, key, value)
        elif not check:
            out[key] = value
        elif key in SECTIONS:
            raise ConfigError(
                f"{key} is a section of the configuration: a table of its fields {_names(key)}, not {value!r}"
            )
        elif dot and section in SECTIONS:
            _not_in_section(section, name)
        else:
            unknown.append(key)
    if unknown:
        raise ConfigError(f"unknown configuration field(s) {sorted(unknown)}; known: {sorted(SECTION_OF)}")
    return out


def _names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _not_in_section(section: str, name: str) -> NoReturn:
    where = f" ({name} is in {SECTION_OF[name]})" if name in SECTION_OF else ""
    raise ConfigError(f"unknown configuration field {section}.{name}{where}; known in {section}: {_names(section)}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The table of a TOML or JSON file (by its suffix), unvalidated; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    try:
        loaded = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(
            f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a table of fields, not {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults <- file (TOML or JSON) <- overrides (``None`` values ignored), validated. The file and the
    overrides may each give fields flat or by section (:func:`flat_fields`); ``params`` merge."""
    data = flat_fields(read_config_file(path)) if path is not None else {}
    for k, v in flat_fields({k: v for k, v in (overrides or {}).items() if v is not None}).items():
        if k == "params":
            data["params"] = {**data.get("params", {}), **v}
        else:
            data[k] = v
    return RunConfig.from_mapping(data).validate()


def _coerce(name: str, value: Any) -> Any:
    """``value`` for field ``name`` if its type fits (an int is a float too); no other conversion. A
    closed-set field's value passes as it is: :meth:`RunConfig.validate` turns it into its member."""
    f = _FIELDS[name]
    t = str(f.type)
    if value is None:
        if "None" in t:
            return None
        raise ConfigError(f"{name} may not be empty")
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "dict": lambda v: isinstance(v, Mapping),
        "str": lambda v: isinstance(v, str),
    }
    for prefix, fits in ok.items():
        if t.startswith(prefix):
            if not fits(value):
                raise ConfigError(f"{name}={value!r} is not a valid {t}")
            if prefix == "float":
                return float(value)
            return dict(value) if prefix == "dict" else value
    return value


def _one_of(name: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {list(allowed)}")


def _choice(name: str, value: Any, kind: type[E]) -> E:
    """``value`` (a string, or already a member) as the member of ``kind`` it names; a
    :class:`ConfigError` naming the field and every value otherwise."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ConfigError(f"{name}={value!r} is not one of {[k.value for k in kind]}")


def _check_device(device: str) -> None:
    """``device``: a :class:`~wafl.common.choices.DeviceKind`, or ``cuda:N``."""
    kind, sep, index = device.partition(":")
    if kind not in [k.value for k in DeviceKind] or (sep and not (kind == DeviceKind.CUDA and index.isdigit())):
        raise ConfigError(f"device={device!r} is not one of auto, cpu, cuda, cuda:N")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} must be a positive number")


def _int_at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low}")


def _in_range(
    name: str, value: float, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ConfigError(f"{name}={value!r} must lie in {lo}{low}, {high}{hi}")


# the field checks, for the plug-ins that check their own sections (server/strategies/): one wording everywhere
one_of, positive, int_at_least, in_range = _one_of, _positive, _int_at_least, _in_range
