"""Configuration is validated once, and every error names the field and the value."""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from wafl.common.config import ConfigError, RunConfig, load_config


def test_defaults_validate() -> None:
    cfg = load_config()
    assert (
        cfg.dataset == "digits"
        and cfg.num_clients == 10
        and cfg.algorithm == "fedavg"
        and cfg.partition == "dirichlet"
        and cfg.alpha == 0.5
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
    assert cfg.rounds == 9 and cfg.params == {
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
    for cfg in (load_config(None, strings), RunConfig(**strings).validate()):
        assert cfg.partition is Partition.IID and cfg.protocol is ClientProtocol.COMPUTE_AND_WAIT
        assert cfg.optimizer is Optimizer.ADAM and cfg.plateau_metric is PlateauMetric.GM_ACCURACY
        for name, text in strings.items():
            assert getattr(cfg, name) == text and f"{getattr(cfg, name)}" == text
            assert f"{name}={getattr(cfg, name)!r}" == f"{name}={text!r}"  # messages quote it as before
        plain = json.loads(cfg.to_json())
        assert {k: plain[k] for k in strings} == strings
        assert all(type(plain[k]) is str for k in strings)
        # config.json: the same text as the fields' plain strings give (what it held before the members)
        assert cfg.to_json() == json.dumps({**dataclasses.asdict(cfg), **strings}, sort_keys=True)
        assert cfg.to_dict() == plain
    again = RunConfig.from_json(cfg.to_json()).validate()
    assert again.to_json() == cfg.to_json() and again.protocol is ClientProtocol.COMPUTE_AND_WAIT


def test_the_defaults_are_members_too() -> None:
    from wafl.common.choices import Partition
    from wafl.common.contract import ClientProtocol

    cfg = RunConfig()
    assert cfg.partition is Partition.DIRICHLET and cfg.protocol is ClientProtocol.WAIT_FREE
    assert cfg.aggregation == "sync" and type(cfg.aggregation) is str
    assert cfg.aggregator == "mean" and type(cfg.aggregator) is str  # the server's registry: an open set
    assert json.loads(cfg.to_json())["protocol"] == "wait-free"


def test_local_evaluation_follows_what_the_rule_declares() -> None:
    """``evaluates_locally`` compares no rule name: lock-step rounds evaluate with the global model
    (``eval_every``), any other rule every time, whatever ``aggregation`` says."""
    for aggregation in ("sync", "buffered", "another-rule"):
        cfg = RunConfig(aggregation=aggregation, rounds=6, eval_every=3)
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
    assert check_aggregation(load_config(None, {"aggregation": "fedasync"})).aggregation == "fedasync"


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
