"""Configuration is validated once, and every error names the field and the value."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from wafl.common.config import (
    SECTION_OF,
    ClientSection,
    ConfigError,
    DataSection,
    EvaluationSection,
    RunConfig,
    TrainingSection,
    load_config,
)


def test_defaults_validate() -> None:
    cfg = load_config()
    assert (
        cfg.data.dataset == "digits"
        and cfg.federation.num_clients == 10
        and cfg.training.algorithm == "fedavg"
        and cfg.data.partition == "dirichlet"
        and cfg.data.alpha == 0.5
    )


@pytest.mark.parametrize(
    "override, words",
    [
        ({"num_clients": 0}, "num_clients=0"),
        ({"pm_nice": 20}, "pm_nice=20"),
        ({"pm_nice": -1}, "pm_nice=-1"),
        ({"alpha": -1.0}, "alpha=-1.0"),
        ({"fraction": 1.5}, "fraction=1.5"),
        ({"protocol": "sometimes"}, "protocol='sometimes'"),
        ({"dataset": "mnist"}, "dataset='mnist'"),
        ({"model": "vgg"}, "model='vgg'"),
        ({"algorithm": "fedfoo"}, "fedfoo"),
        ({"algorithm": "fedavg+bar"}, "regularizer 'bar'"),
        ({"algorithm": "fedprox", "params": {"mu": -1}}, "params.mu=-1"),
        ({"algorithm": "fedavg", "params": {"mu": 1}}, "['mu'] do not apply"),
        ({"algorithm": "scd", "params": {"spectrum": "wavelet"}}, "params.spectrum='wavelet'"),
        ({"algorithm": "fedhkd", "params": {"delta": 1.5}}, "params.delta=1.5"),
        ({"algorithm": "fedhkd", "params": {"zeta": 0}}, "params.zeta=0"),
        ({"min_clients": 20}, "min_clients=20"),
        ({"rollback_memory_mb": -1}, "rollback_memory_mb must be a finite number >= 0 (got -1.0)"),
        ({"rollback_upload_mb": float("nan")}, "rollback_upload_mb must be a finite number >= 0 (got nan)"),
        ({"rollback_upload_mb": "2"}, "rollback_upload_mb='2' is not a valid float"),
        ({"device": "tpu"}, "device='tpu'"),
        ({"lr": "fast"}, "lr='fast'"),
    ],
)
def test_errors_name_the_field_and_value(override: dict, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert words in str(e.value)


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown configuration field"):
        RunConfig.from_mapping({"round": 3})


def test_file_then_overrides(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('algorithm = "fedprox+asd"\nrounds = 7\n[params]\nmu = 0.1\nasd_lambda = 5\n')
    cfg = load_config(f, {"rounds": 9, "params": {"asd_temperature": 3}})
    assert cfg.federation.rounds == 9 and cfg.training.params == {
        "mu": 0.1,
        "asd_lambda": 5.0,
        "asd_temperature": 3.0,
        "asd_uniform": False,
    }
    again = RunConfig.from_json(cfg.to_json()).validate()
    assert json.loads(again.to_json()) == json.loads(cfg.to_json())


def test_bad_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"partition": "random"}, "partition='random' is not one of ['dirichlet', 'dirichlet-equal', 'iid']"),
        ({"protocol": "sometimes"}, "protocol='sometimes' is not one of ['wait-free', 'compute-and-wait', 'adaptive']"),
        ({"optimizer": "lbfgs"}, "optimizer='lbfgs' is not one of ['sgd', 'adam']"),
        ({"plateau_metric": "loss"}, "plateau_metric='loss' is not one of ['auto', 'gm_accuracy', 'pm_accuracy']"),
        ({"partition": 3}, "partition=3 is not one of ['dirichlet', 'dirichlet-equal', 'iid']"),
        ({"device": "cpu:0"}, "device='cpu:0' is not one of auto, cpu, cuda, cuda:N"),
    ],
)
def test_a_closed_set_error_names_the_field_and_every_value(override: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert str(e.value) == message


def test_closed_sets_become_their_members_and_stay_their_strings() -> None:
    from wafl.common.choices import Optimizer, Partition, PlateauMetric
    from wafl.common.contract import ClientProtocol

    strings = {
        "partition": "iid",
        "protocol": "compute-and-wait",
        "optimizer": "adam",
        "plateau_metric": "gm_accuracy",
    }
    # a constructor's strings are converted by validate as a file's are
    constructed = RunConfig(
        data=DataSection(partition="iid"),
        training=TrainingSection(optimizer="adam"),
        client=ClientSection(protocol="compute-and-wait"),
        evaluation=EvaluationSection(plateau_metric="gm_accuracy"),
    )
    for cfg in (load_config(None, strings), constructed.validate()):
        assert cfg.data.partition is Partition.IID and cfg.client.protocol is ClientProtocol.COMPUTE_AND_WAIT
        assert cfg.training.optimizer is Optimizer.ADAM and cfg.evaluation.plateau_metric is PlateauMetric.GM_ACCURACY
        for name, text in strings.items():
            value = getattr(getattr(cfg, SECTION_OF[name]), name)
            assert value == text and f"{value}" == text
            assert f"{name}={value!r}" == f"{name}={text!r}"  # messages quote it as before
        plain = json.loads(cfg.to_json())
        assert {k: plain[k] for k in strings} == strings
        assert all(type(plain[k]) is str for k in strings)
        # config.json: the same text as the fields' plain strings give (what it held before the members)
        fields = {k: v for section in dataclasses.asdict(cfg).values() for k, v in section.items()}
        assert cfg.to_json() == json.dumps({**fields, **strings}, sort_keys=True)
        assert cfg.to_dict() == plain
    again = RunConfig.from_json(cfg.to_json()).validate()
    assert again.to_json() == cfg.to_json() and again.client.protocol is ClientProtocol.COMPUTE_AND_WAIT


def test_the_defaults_are_members_too() -> None:
    from wafl.common.choices import Partition
    from wafl.common.contract import ClientProtocol

    cfg = RunConfig()
    assert cfg.data.partition is Partition.DIRICHLET and cfg.client.protocol is ClientProtocol.WAIT_FREE
    assert cfg.rule.aggregation == "sync" and type(cfg.rule.aggregation) is str
    assert cfg.security.aggregator == "mean" and type(cfg.security.aggregator) is str  # the server's: an open set
    assert json.loads(cfg.to_json())["protocol"] == "wait-free"


def test_local_evaluation_follows_what_the_rule_declares() -> None:
    """``evaluates_locally`` compares no rule name: lock-step rounds evaluate with the global model
    (``eval_every``), any other rule every time, whatever ``aggregation`` says."""
    for aggregation in ("sync", "buffered", "another-rule"):
        cfg = RunConfig.from_mapping({"aggregation": aggregation, "rounds": 6, "eval_every": 3})
        assert [cfg.evaluates_locally(r, lock_step=True) for r in range(1, 7)] == [
            False,
            False,
            True,
            False,
            False,
            True,
        ]
        assert all(cfg.evaluates_locally(r, lock_step=False) for r in range(1, 7))


def test_validate_knows_no_rule_and_the_rules_check_it() -> None:
    """The rule name is checked where the rules are known, by an explicit call: the same answer
    whatever was imported before."""
    from wafl.server.strategies import check_aggregation

    cfg = load_config(None, {"aggregation": "bogus"})  # the rules are imported: validate still knows none
    with pytest.raises(ConfigError) as e:
        check_aggregation(cfg)
    assert str(e.value) == "aggregation='bogus' is not one of ['buffered', 'fedasync', 'sync']"
    assert check_aggregation(load_config(None, {"aggregation": "fedasync"})).rule.aggregation == "fedasync"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            {"aggregation": "buffered", "staleness": "cubic"},
            "staleness='cubic' is not one of ['constant', 'hinge', 'poly', 'sqrt']",
        ),
        ({"aggregator": "mode"}, "aggregator='mode' is not one of ['mean', 'trimmed_mean', 'median']"),
    ],
)
def test_a_rule_checks_its_own_fields_and_the_server_its_aggregators(override: dict, message: str) -> None:
    """``staleness`` is an asynchronous rule's setting and ``aggregator`` names a robust center the server
    registers: ``check_aggregation`` refuses what they do not know; a run of another rule ignores
    ``staleness``, as before."""
    from wafl.server.strategies import check_aggregation

    cfg = load_config(None, override)
    with pytest.raises(ConfigError) as e:
        check_aggregation(cfg)
    assert str(e.value) == message
    check_aggregation(load_config(None, {"aggregation": "sync", "staleness": "cubic"}))


def _fresh_python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240, cwd=cwd)


def test_common_config_consults_no_registry_that_importing_server_code_fills() -> None:
    """In a fresh interpreter (import order controlled): validation gives the same answer before and
    after the server's rules and aggregator are imported, and importing them changes nothing in
    ``wafl.common.config``."""
    code = textwrap.dedent(
        """
        import sys
        import wafl.common.config as config

        def state():
            return {k: repr(v) for k, v in vars(config).items() if isinstance(v, (dict, list, set))}

        assert not any(m.startswith("wafl.server") for m in sys.modules), "common imported server code"
        before = state()
        first = config.load_config(None, {"aggregation": "bogus", "aggregator": "median"}).to_json()
        import wafl.server.aggregation.rule, wafl.server.strategies  # noqa: E401
        assert state() == before, "importing server code changed wafl.common.config"
        assert config.load_config(None, {"aggregation": "bogus", "aggregator": "median"}).to_json() == first
        unknown = config.load_config(None, {"aggregator": "bogus"})  # the server's registry names the centers
        try:
            wafl.server.strategies.check_aggregation(unknown)
        except config.ConfigError as e:
            print(e)
        """
    )
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "aggregator='bogus' is not one of ['mean', 'trimmed_mean', 'median']"


@pytest.mark.parametrize("command", ["run", "server", "sweep"])
def test_the_wafl_command_refuses_an_unknown_rule_in_one_line(tmp_path: Path, command: str) -> None:
    """``wafl run``, ``wafl server`` and ``wafl sweep`` in a fresh interpreter that imports nothing but the
    command line before it runs: one line naming the field and every rule, exit status 2, nothing written."""
    rule = "aggregation='bogus' is not one of ['buffered', 'fedasync', 'sync']"
    if command == "sweep":
        sweep = tmp_path / "bogus.toml"
        sweep.write_text(f'out = "{tmp_path / "o"}"\n[base]\naggregation = "bogus"\n[grid]\nseed = [0, 1]\n')
        args, message = ["sweep", str(sweep)], f"sweep point {{'seed': 0}}: {rule}"
    else:
        args = [command, "--aggregation", "bogus", "--rounds", "1", "--clients", "2", "--out", str(tmp_path / "o")]
        message = rule
    code = "import sys\nfrom wafl.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    done = _fresh_python(code, *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"wafl: configuration error: {message}"]
    assert not (tmp_path / "o").exists()


# The JSON of the default configuration as the flat RunConfig wrote it (9ab00e5): config.json, JoinReply.config_json
# and the sweep records compare configurations by these bytes. Fields added since (grad_clip, lr_decay) follow in
# DEFAULT_JSON; a configuration written before them reads back with their defaults.
DEFAULT_JSON_9AB00E5 = (
    '{"act_prob": null, "aggregation": "sync", "aggregation_params": {}, "aggregator": "mean", "algorithm": "fedavg", '
    '"alpha": 0.5, "batch_size": 32, "broadcast_all": false, "buffer_size": null, "checkpoint": true, '
    '"client_size": null, "clip_norm": null, "code_len": 32, "concurrency": null, "data_dir": null, '
    '"dataset": "digits", "delta": 0.3, "device": "auto", "dropout": 0.0, "eval_batch_size": 256, "eval_every": 1, '
    '"final_report_s": 30.0, "fraction": 1.0, "grad_dissimilarity_every": 0, "join_timeout_s": 300.0, '
    '"keep_checkpoint_every": 0, "local_epochs": 2, "local_test_fraction": 0.25, "lr": 0.05, '
    '"max_round_retries": 3, "max_staleness": 20, "min_clients": null, "model": "cnn", "momentum": 0.9, '
    '"new_client_epochs": 1, "new_clients": 0, "norm_bound": 10.0, "num_clients": 10, "optimizer": "sgd", '
    '"params": {}, "partition": "dirichlet", "plateau_delta": 0.3, "plateau_metric": "auto", "plateau_window": 0, '
    '"plateau_z": 0.0, "pm_epochs": 1, "pm_max_epochs": null, "pm_min_steps": 0, "pm_nice": 19, '
    '"pm_yield_transfers": false, "protocol": "wait-free", "rollback_memory_mb": 256.0, "rollback_upload_mb": 2.0, '
    '"round_deadline_s": 120.0, "rounds": 25, "seed": 0, "server_lr": 1.0, "slowdown": "none", "staleness": "sqrt", '
    '"staleness_a": 0.5, "staleness_b": 4, "tensorboard": null, "trim_fraction": 0.1, "upload_stall_s": 30.0, '
    '"weight_decay": 0.0}'
)


DEFAULT_JSON = DEFAULT_JSON_9AB00E5.replace('"fraction": 1.0, ', '"fraction": 1.0, "grad_clip": 0.0, ').replace(
    '"lr": 0.05, ', '"lr": 0.05, "lr_decay": 1.0, '
)


def test_the_flat_json_is_written_as_before() -> None:
    assert RunConfig().to_json() == DEFAULT_JSON
    cfg = RunConfig.from_json(DEFAULT_JSON)
    assert cfg == RunConfig() and cfg.to_json() == DEFAULT_JSON
    assert load_config().to_json() == DEFAULT_JSON  # validation fills in fedavg's (empty) params
    assert RunConfig.from_json(DEFAULT_JSON_9AB00E5) == RunConfig()  # an older config.json: the new fields' defaults


def test_every_field_has_one_section_and_no_section_is_a_field() -> None:
    sections = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert list(sections) == ["data", "federation", "rule", "security", "training", "client", "evaluation", "output"]
    assert sorted(SECTION_OF) == sorted(json.loads(DEFAULT_JSON))
    assert not set(sections) & set(SECTION_OF)
    cfg = RunConfig()
    for name, section in SECTION_OF.items():
        assert hasattr(getattr(cfg, section), name) and not hasattr(cfg, name), name


def test_files_may_give_fields_by_section(tmp_path: Path) -> None:
    """A TOML table or a JSON object per section, a ``section.field`` key, flat keys, or any mix of them: the
    same configuration, the same ``config.json``."""
    flat = tmp_path / "flat.toml"
    flat.write_text('lr = 0.1\nalgorithm = "fedprox"\nnum_clients = 4\n[params]\nmu = 0.5\n')
    toml = tmp_path / "sections.toml"
    toml.write_text(
        '[training]\nlr = 0.1\nalgorithm = "fedprox"\nparams = { mu = 0.5 }\n[federation]\nnum_clients = 4\n'
    )
    js = tmp_path / "sections.json"
    js.write_text(
        json.dumps({"training": {"lr": 0.1, "algorithm": "fedprox", "params": {"mu": 0.5}}, "num_clients": 4})
    )
    want = load_config(flat)
    assert want.training.lr == 0.1 and want.federation.num_clients == 4 and want.training.params == {"mu": 0.5}
    for path in (toml, js):
        assert load_config(path).to_json() == want.to_json()
    assert load_config(None, {"training.lr": 0.1, "algorithm": "fedprox", "federation": {"num_clients": 4},
                              "params": {"mu": 0.5}}).to_json() == want.to_json()  # fmt: skip
    # flags over a file by section: the flag wins, params merge
    again = load_config(toml, {"lr": 0.2, "params": {"mu": 0.25}})
    assert (again.training.lr, again.training.params, again.federation.num_clients) == (0.2, {"mu": 0.25}, 4)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"round": 3},
            f"unknown configuration field(s) ['round']; known: {sorted(SECTION_OF)}",
        ),
        (
            {"training": {"seed": 1}},
            "unknown configuration field training.seed (seed is in federation); known in training: "
            "['model', 'code_len', 'algorithm', 'params', 'optimizer', 'lr', 'lr_decay', 'momentum', 'weight_decay', "
            "'grad_clip', 'batch_size', 'local_epochs', 'device']",
        ),
        (
            {"output.lr": 0.1},
            "unknown configuration field output.lr (lr is in training); known in output: "
            "['checkpoint', 'keep_checkpoint_every', 'tensorboard']",
        ),
        ({"lr": 0.1, "training": {"lr": 0.2}}, "lr is given twice (lr and training.lr)"),
        (
            {"output": 3},
            "output is a section of the configuration: a table of its fields "
            "['checkpoint', 'keep_checkpoint_every', 'tensorboard'], not 3",
        ),
        ({"training": {"lr": "fast"}}, "lr='fast' is not a valid float"),
    ],
)
def test_a_misplaced_field_is_refused_by_name(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        RunConfig.from_mapping(data)
    assert str(e.value) == message


def test_set_and_sweep_keys_may_name_a_section(tmp_path: Path) -> None:
    from wafl.cli.config_flags import resolve_config
    from wafl.cli.experiments.sweep import load_sweep
    from wafl.cli.parser import build_parser

    a = build_parser().parse_args(["run", "--set", "training.lr=0.2", "--set", "pm_epochs=2", "--rounds", "3"])
    cfg = resolve_config(a)
    assert (cfg.training.lr, cfg.client.pm_epochs, cfg.federation.rounds) == (0.2, 2, 3)
    parent = tmp_path / "parent.toml"
    parent.write_text(
        '[base]\nnum_clients = 3\nlr = 0.1\n[base.federation]\nrounds = 2\n[grid]\n"training.lr" = [0.1, 0.2]\n'
    )
    child = tmp_path / "child.toml"
    child.write_text('extends = "parent.toml"\n[base.training]\nmomentum = 0.5\n[base]\nrounds = 4\n')
    _, points = load_sweep(parent)
    assert [(n, c.training.lr, c.federation.rounds) for n, c in points] == [
        ("training.lr=0.1", 0.1, 2),
        ("training.lr=0.2", 0.2, 2),
    ]
    _, points = load_sweep(child)  # the child's base fields over the parent's, field by field
    assert {(c.training.lr, c.training.momentum, c.federation.rounds, c.federation.num_clients) for _, c in points} == {
        (0.1, 0.5, 4, 3),
        (0.2, 0.5, 4, 3),
    }
