"""Configuration is validated once, and every error names the field and the value."""

import json

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
