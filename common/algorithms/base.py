"""The algorithm interface: what an algorithm is made of, and the context its parts read.

An algorithm is *declared* in its one file (it calls :func:`~wafl.common.algorithms.registry.register`)
and run by shared machinery: one trainer (:func:`wafl.common.training.run_phase`), one client
runtime (:mod:`wafl.client.trainer`, :mod:`wafl.client.protocol`) and one server. It states:

* **what travels** (:attr:`Algorithm.shares`, :attr:`Algorithm.extras`): the model's tensors it
  shares (``MODEL`` = all of them, ``BODY`` = the feature extractor, ``HEAD`` = the classifier,
  ``NOTHING``, or any predicate over ``state_dict`` names) plus extra named tensors (control
  variates, a generator, scores on a public set) whose initial values the server starts from.
  The server sends the global values of exactly these tensors, each selected client uploads
  its own values of them (:meth:`ClientHooks.upload`), the server averages them with the
  algorithm's weights and its :class:`ServerUpdate` turns the mean into the next global values
  (server-side work between rounds goes there). Tensors that do not travel stay on the client
  and persist across rounds and restarts (FedRep's head);
* **the client's phases** (:class:`Phase`): each with the parameters it trains (``all``,
  ``body``, ``head``), its optimizer (the run's by default, fresh per phase), its epochs or
  steps, its data (the client's shard or the public split), its loss terms (added to
  cross-entropy unless ``cross_entropy=False``) and optionally a custom step (:class:`StepRule`,
  e.g. SAM's ascent-then-descent or SCAFFOLD's corrected gradient). Simple methods only list
  loss terms (``gm_terms``): one phase over the whole model for ``local_epochs``;
* **per-client state** that persists across rounds and restarts: ``ctx.client_state`` (saved
  with the client's state file after every phase), and the non-travelling part of the model;
* **data besides the shard**: ``public_size`` samples of the train split, drawn
  deterministically from the seed and removed from every client's partition;
* **the personal model** (:attr:`Algorithm.personal`): ``"none"``; ``"local"`` (the local model
  right after local training, or after its personal phase); ``"separate"`` (a second model that
  never travels, as Ditto's and SCD's PM). A personal phase (``pm_phase``) trains it batch after
  batch until the next broadcast (wait-free) or for ``pm_epochs`` (compute-and-wait);
  ``pm_from_global`` restarts it from each received global model (FedBABU's fine-tuning),
  ``pm_view`` picks what is evaluated (FedRoD's generic + personal logits),
  ``pm_on_received`` evaluates a local PM with the next received global model's shared tensors
  loaded (FedRep: the received global body with the client's personal head) instead of the
  client's own trained ones, ``pm_by_local_round`` says the local phases train the PM themselves
  (pFedMe's theta: a new client adapts by running them), and ``pm_when_unselected`` says whether a client that was not
  selected for a round trains its personal part on the model it received (README, "Partial
  participation");
* **the knowledge** it shares per class (FedHKD, FedProto), weighted by counts or uniformly
  over the clients that hold the class (``knowledge_weighting``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.models.base import SplitModel, submodule

if TYPE_CHECKING:
    from wafl.common.knowledge import Knowledge


class AlgorithmStateError(RuntimeError):
    """A part of an algorithm ran without the state it needs: a personal model the run did not build,
    or a loss term or step rule used before its phase's ``begin``. The message names the part and
    what was missing (a defect in how the part is wired, never a bad setting)."""


class RoundContext:
    """What a client knows during one round: the received global model and knowledge, its own state.

    ``teacher`` (a frozen eval-mode copy of the received global model) and ``global_params`` are
    built on first use only, so algorithms that need neither pay nothing.
    """

    def __init__(
        self,
        round: int,
        global_state: Mapping[str, torch.Tensor],
        gm: SplitModel,
        pm: SplitModel | None,
        label_freq: torch.Tensor,
        client_state: dict[str, Any],
        knowledge: Knowledge | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
        selected: bool = True,
        public: Any = None,
        index: int = 0,
        label_counts: torch.Tensor | None = None,
    ) -> None:
        self.round = round
        self.global_state = global_state  # the received model tensors (the shared part of the model)
        self.gm = gm
        self.pm = pm
        self.label_freq = label_freq
        self.client_state = client_state
        self.knowledge = knowledge or {}
        self.extras: dict[str, torch.Tensor] = dict(extras or {})  # the received extra tensors, by short name
        self.selected = selected
        self.index = index  # the client's index (seeds for a method's own sampling)
        self.label_counts = label_counts if label_counts is not None else label_freq  # per-class train counts
        self.public = public  # the public split's batches factory, for algorithms that declare one

    @cached_property
    def teacher(self) -> SplitModel:
        t = copy.deepcopy(self.gm)
        t.load_state_dict(self.global_state, strict=False)
        t.eval()
        for p in t.parameters():
            p.requires_grad_(False)
        return t

    @cached_property
    def global_params(self) -> list[torch.Tensor]:
        """The received global model's trainable parameters, in ``model.parameters()`` order, detached."""
        return [p.detach() for p in self.teacher.parameters()]


class Forward:
    """One batch's forward pass, shared by every loss term of the phase."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, ctx: RoundContext
    ) -> None:
        self.x, self.y, self.h, self.logits, self._ctx = x, y, h, logits, ctx

    @cached_property
    def teacher_logits(self) -> torch.Tensor:
        with torch.no_grad():
            return self._ctx.teacher(self.x)


class LossTerm(ABC):
    """A term added to cross-entropy. ``begin``/``end`` run once per training phase."""

    name = "term"

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        """Prepares per-round constants (anchors, teacher spectra, client state)."""

    @abstractmethod
    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        """The term's value on one batch (with its gradient)."""

    def end(self, ctx: RoundContext, model: nn.Module) -> None:
        """Updates client state once the phase has trained ``model``."""


@dataclass(frozen=True)
class StepContext:
    """What a step rule sees for one batch, built by the trainer (:func:`wafl.common.training.run_phase`).

    ``model``: the model the phase trains; ``params``: its trained parameters (the optimizer's,
    in ``model.parameters()`` order); ``closure()``: recomputes the batch's forward pass and loss
    at the current weights (SAM calls it twice); ``optimizer``: the phase's optimizer; ``batch``:
    the ``(x, y)`` the closure reads, for rules that evaluate another model on it (pFedMe's
    personal model).
    """

    model: nn.Module
    params: list[nn.Parameter]
    closure: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]


class StepRule:
    """How one batch turns into an update; the default is ``zero_grad, backward, step``.

    :meth:`step` reads the batch's :class:`StepContext` and returns the batch's loss;
    ``begin``/``end`` run once per phase, like a loss term's.
    """

    def begin(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        pass

    def step(self, ctx: StepContext) -> torch.Tensor:
        loss = backward(ctx.closure, ctx.optimizer)
        ctx.optimizer.step()
        return loss

    def end(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        pass


class ClippedStep(StepRule):
    """The default step with the gradient's L2 norm (over the phase's trained parameters) clipped to
    ``max_norm`` before the optimizer steps; ``when`` (None: always) decides per round, in :meth:`begin`,
    whether this round's steps are clipped."""

    def __init__(self, max_norm: float, when: Callable[[RoundContext], bool] | None = None) -> None:
        self.max_norm = max_norm
        self.when = when
        self.active = True

    def begin(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        self.active = self.when is None or self.when(ctx)

    def step(self, ctx: StepContext) -> torch.Tensor:
        loss = backward(ctx.closure, ctx.optimizer)
        if self.active:
            torch.nn.utils.clip_grad_norm_(ctx.params, self.max_norm)
        ctx.optimizer.step()
        return loss


def with_knowledge(ctx: RoundContext) -> bool:
    """Whether the round trains with global knowledge (FedHKD's and FedProto's rounds after the first)."""
    return bool(ctx.knowledge)


def clipped_with_knowledge(max_norm: float) -> ClippedStep | None:
    """The step of FedHKD's code (FedHKD's and FedProto's): clipped to ``max_norm`` in the rounds with global
    knowledge; None (the default step) for ``max_norm = 0``."""
    return ClippedStep(max_norm, with_knowledge) if max_norm else None


def backward(closure: Callable[[], torch.Tensor], opt: torch.optim.Optimizer) -> torch.Tensor:
    """The batch's loss at the current weights, its gradients left in ``.grad`` (cleared first)."""
    loss = closure()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss


OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
ParamSet = Literal["all", "body", "head"] | Callable[[nn.Module], list[nn.Parameter]]


@dataclass
class Phase:
    """One local training phase of a client.

    ``params``: which parameters train (the others are frozen for the phase). ``epochs``: passes
    over the phase's data (None: the run's ``local_epochs``); ``steps``: a number of batches
    instead. ``optimizer``: a factory over the trained parameters (None: the run's optimizer,
    fresh each phase). ``main``: composed regularizers (``+asd``) join this phase's terms.
    ``forward``: ``model -> (x -> (h, logits))`` when the phase's logits are not the model's own
    (FedRoD's personal head). On the public split (``data="public"``) a batch's ``y`` is each
    sample's position in the split, not its label (FedMD's consensus rows).
    """

    name: str = "gm"
    terms: list[LossTerm] = field(default_factory=list)
    params: ParamSet = "all"
    epochs: float | None = None
    steps: int | None = None
    optimizer: OptimizerFactory | None = None
    step: StepRule | None = None
    cross_entropy: bool = True
    data: Literal["local", "public"] = "local"
    main: bool = True
    forward: Callable[[nn.Module], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] | None = None
    when: Callable[[RoundContext], bool] | None = None  # None: every round; else the phase runs when true


def parameters_of(model: nn.Module, which: ParamSet) -> list[nn.Parameter]:
    """The trainable parameters of ``which`` part of a :class:`SplitModel` (``all``: every one, in order;
    a callable picks them itself)."""
    if callable(which):
        return list(which(model))
    if which == "all":
        return [p for p in model.parameters() if p.requires_grad]
    part = submodule(model, "features" if which == "body" else "classifier")
    return [p for p in part.parameters() if p.requires_grad]


class ClientHooks:
    """Client work outside the phases: before them (``begin``), and the extra tensors uploaded
    after them (``upload``: every name of :attr:`Algorithm.extras`, as the values the server
    averages)."""

    def begin(self, ctx: RoundContext) -> None:
        pass

    def upload(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        return {}


class ServerUpdate:
    """The server side: how uploads are weighted and how their mean becomes the next global model.

    The default is FedAvg: weights are sample counts and the new global is the weighted mean.
    :meth:`weight` also sees the metrics the upload's header declares (its ``train_steps``, ...),
    and under lock-step rounds :meth:`collected` is told every committed upload of the round
    (sample count and metrics) just before :meth:`finalize` (FedNova normalizes by local steps).
    ``prev`` and ``mean`` hold every tensor that travels, extra tensors included (names from
    :func:`extra_name`); ``finalize`` is the server's work between rounds.
    State kept across rounds goes through ``state_dict``/``load_state_dict`` into checkpoints.
    ``buffered_ok`` is False for updates that need one round's full models (their state would
    be built from stale deltas under buffered aggregation, which refuses them).
    """

    buffered_ok = True
    # under a robust center (median, trimmed mean; sync rounds), each upload's update of the trained tensors
    # enters it multiplied by the upload's weight (FedNova's normalized updates); False: the center ignores them
    robust_scaled = False

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        """An upload's weight in the mean, from its sample count and declared metrics."""
        return float(num_samples)

    def collected(self, uploads: list[tuple[int, Mapping[str, float]]]) -> None:
        """The round's committed uploads, ``(num_samples, metrics)`` each, before :meth:`finalize`."""

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        return mean

    def scored(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The model the server evaluates after :meth:`finalize` made ``state`` the global one: by default that
        model itself (FedDyn's code scores the participants' mean instead, ``FedDynUpdate``)."""
        return state

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


KnowledgeExtractor = Callable[
    [SplitModel, Iterable[tuple[torch.Tensor, torch.Tensor]], RoundContext, torch.Generator], "Knowledge"
]


EXTRA_PREFIX = "extra."


def extra_name(name: str) -> str:
    """The travelling name of an extra tensor (never a model ``state_dict`` name)."""
    return EXTRA_PREFIX + name


def MODEL(name: str) -> bool:
    return True


def BODY(name: str) -> bool:
    return name.startswith("features.")


def HEAD(name: str) -> bool:
    return name.startswith("classifier.")


def NOTHING(name: str) -> bool:
    return False


@dataclass
class Algorithm:
    """A resolved algorithm: its name, validated parameters and parts (see the module docstring)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)  # by public name; registry.resolve sets them
    gm_terms: list[LossTerm] = field(default_factory=list)
    pm_terms: list[LossTerm] | None = None  # not None: a separate PM trained with these terms (Ditto, SCD)
    knowledge: KnowledgeExtractor | None = None  # shared after local training (FedHKD, FedProto)
    server: ServerUpdate = field(default_factory=ServerUpdate)
    local_model_is_personal: bool = False  # shorthand for personal="local" without a personal phase
    privacy: Callable[[int], dict[str, Any]] | None = None  # releases -> the DP guarantee, for the record
    # what travels
    shares: Callable[[str], bool] = MODEL
    extras: Callable[[SplitModel], dict[str, torch.Tensor]] | None = None  # initial global values
    evaluates_global: bool = True  # False: the shared tensors make no model worth testing (gm_accuracy null)
    wrap: Callable[[SplitModel], SplitModel] | None = None  # the model the clients and the server build
    # the client
    phases: list[Phase] | None = None  # None: one phase over the whole model with gm_terms
    hooks: ClientHooks = field(default_factory=ClientHooks)
    public_size: int = 0  # samples of the train split held out as a public split
    # the personal model
    personal: Literal["none", "local", "separate"] | None = None
    pm_phase: Phase | None = None
    pm_from_global: bool = False
    pm_view: Callable[[SplitModel], nn.Module] | None = None
    # True: the PM trained in a round is evaluated once the next global model's shared tensors are loaded
    pm_on_received: bool = False
    # True: the local phases train the PM (pFedMe's theta), so a new client's adaptation runs them
    pm_by_local_round: bool = False
    pm_when_unselected: bool = False
    knowledge_weighting: Literal["count", "uniform"] = "count"

    def __post_init__(self) -> None:
        if self.personal is None:
            if self.pm_terms is not None:
                self.personal = "separate"
            elif self.local_model_is_personal or self.pm_phase is not None:
                self.personal = "local"
            else:
                self.personal = "none"
        if self.personal == "separate" and self.pm_phase is None:
            self.pm_phase = Phase("pm", terms=self.pm_terms if self.pm_terms is not None else [], main=False)
        if self.pm_phase is not None and self.pm_terms is None:
            self.pm_terms = self.pm_phase.terms
        if self.personal == "local" and self.pm_phase is None:
            self.local_model_is_personal = True
        if self.phases is None:
            self.phases = [Phase("gm", terms=self.gm_terms)]  # the same list: composed terms join it
        if self.pm_by_local_round and self.personal != "separate":
            raise ValueError(f"algorithm {self.name!r}: pm_by_local_round needs a separate personal model")
        if self.pm_on_received and not (self.personal == "local" and self.pm_phase is not None):
            raise ValueError(
                f"algorithm {self.name!r}: pm_on_received needs a local personal model trained by a personal phase"
            )

    @property
    def personalized(self) -> bool:
        """A personal phase trains the PM (wait-free: until the next broadcast; reported after it)."""
        return self.pm_phase is not None

    def trains_pm(self, selected: bool) -> bool:
        """Whether a client's round trains the PM: after the GM (selected), or alone on the model it
        received when the algorithm trains the personal part of unselected clients."""
        return self.personalized and (selected or self.pm_when_unselected)

    def add_terms(self, terms: list[LossTerm]) -> None:
        """Composition (``+asd``): the terms join every main phase."""
        seen: set[int] = set()
        for ph in self.phases or []:
            if ph.main and id(ph.terms) not in seen:
                seen.add(id(ph.terms))
                if ph.terms is not self.gm_terms:
                    ph.terms.extend(terms)
        self.gm_terms.extend(terms)

    def build(self, model: SplitModel) -> SplitModel:
        return self.wrap(model) if self.wrap is not None else model

    def payload(self, model: SplitModel) -> OrderedDict[str, torch.Tensor]:
        """The tensors that travel, by name, with their current values in ``model`` (plus the
        extras' initial values)."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict(
            (k, v.detach().clone()) for k, v in model.state_dict().items() if self.shares(k)
        )
        if self.extras is not None:
            for k, v in self.extras(model).items():
                out[extra_name(k)] = v.detach().clone().contiguous()
        return out


def split_payload(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(model tensors, extra tensors by short name)`` of a received or global payload."""
    model = {k: v for k, v in state.items() if not k.startswith(EXTRA_PREFIX)}
    extras = {k[len(EXTRA_PREFIX) :]: v for k, v in state.items() if k.startswith(EXTRA_PREFIX)}
    return model, extras


def cross_entropy(out: Forward) -> torch.Tensor:
    return F.cross_entropy(out.logits, out.y)
