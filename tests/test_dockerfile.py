"""The Dockerfile, read without an engine: its stages and layers, the build context's allow-list, the
dependency split, and pip settings entering only as build secrets (tests/test_pip_settings.py checks
scripts/pip-settings.py, which reads them; tests/test_docker_engine.py builds the image)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from support.docker_helpers import DOCKERFILE, IGNORE, REPO, dockerfile_instructions


def test_dockerfile_structure() -> None:
    ins = dockerfile_instructions()
    runtime = ins[max(i for i, (w, r) in enumerate(ins) if w == "FROM") :]
    users = [r for w, r in runtime if w == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    entry = json.loads(next(r for w, r in runtime if w == "ENTRYPOINT"))
    assert entry[-1] == "wafl-entrypoint"
    health = next(r for w, r in runtime if w == "HEALTHCHECK")
    assert json.loads(health[health.index("CMD") + 3 :].strip()) == ["wafl-entrypoint", "--health"]
    # the script and its package side by side, the command on the PATH a link to the script
    copies = [r.split()[-2:] for w, r in runtime if w == "COPY"]
    assert ["docker/entrypoint.py", "/opt/wafl-entrypoint/entrypoint.py"] in copies
    assert ["docker/wafl_entry", "/opt/wafl-entrypoint/wafl_entry"] in copies
    link = "ln -s /opt/wafl-entrypoint/entrypoint.py /usr/local/bin/wafl-entrypoint"
    assert any(w == "RUN" and link in r for w, r in runtime)
    assert any(w == "ARG" and r == "TORCH_VARIANT=cpu" for w, r in ins)
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE.read_text()
    # dependencies are installed before the package source is copied (cache layering)
    deps_install = next(
        i for i, (w, r) in enumerate(ins) if w == "RUN" and "requirements.txt" in r and "pip install" in r
    )
    first_source = next(
        i for i, (w, r) in enumerate(ins) if w == "COPY" and r.split()[0] in ("common", "server", "client", "cli")
    )
    assert deps_install < first_source


def test_dockerfile_base_image_and_pip_settings() -> None:
    """The base is a build argument; the machine's pip settings enter as build secrets, never a layer."""
    ins = dockerfile_instructions()
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in ins[:first_from]
    stages = set()
    for word, rest in ins:
        if word == "FROM":
            image, _, stage = rest.partition(" AS ")
            assert image == "${BASE_IMAGE}" or image in stages, rest
            stages.add(stage.strip())
    assert {"requirements", "deps", "wheel", "runtime"} <= stages
    installs = [r for w, r in ins if w == "RUN" and "pip install" in r]
    assert installs
    for run in installs:
        offline = "--no-deps" in run and "--mount=type=secret" not in run  # the wafl wheel, built in the image
        secrets = "--mount=type=secret,id=pip.conf" in run and "--mount=type=secret,id=pip-cert" in run
        assert offline or secrets, run
        if secrets:
            assert "PIP_CONFIG_FILE=/run/secrets/pip.conf" in run and "PIP_CERT=/run/secrets/pip-cert" in run
    for word, rest in ins:  # no layer, environment or argument of the image carries pip's settings
        if word in ("ENV", "ARG", "LABEL", "COPY", "ADD"):
            assert "PIP_" not in rest and "pip.conf" not in rest and "pip-cert" not in rest, rest
    runtime = ins[max(i for i, (w, r) in enumerate(ins) if w == "FROM") :]
    assert runtime[0] == ("FROM", "deps AS runtime")  # the dependencies' layers, not a copy of the venv
    assert not any(w == "COPY" and "/opt/venv" in r for w, r in ins)


def test_dockerfile_sources_are_in_the_build_context() -> None:
    """Every COPY source exists and passes the allow-list of Dockerfile.dockerignore."""
    allowed = [line[1:] for line in IGNORE.read_text().splitlines() if line.startswith("!")]
    assert "*" in IGNORE.read_text().splitlines()  # everything else is excluded
    sources = []
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded from the build context"


def test_dockerfile_dependency_split(tmp_path: Path) -> None:
    """The requirements stage's script puts torch/torchvision apart from the other dependencies."""
    run = shlex.split(next(r for w, r in dockerfile_instructions() if w == "RUN" and "tomllib" in r))
    code = run[run.index("-c") + 1]
    code = code.replace("/src/pyproject.toml", str(REPO / "pyproject.toml")).replace("/requirements/", f"{tmp_path}/")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = (tmp_path / "torch.txt").read_text().split()
    rest = (tmp_path / "requirements.txt").read_text().split()
    assert sorted(d.split("==")[0] for d in torch) == ["torch", "torchvision"]
    assert sorted(torch + rest) == sorted(deps)


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml names the packages one by one (``[tool.setuptools] packages``): a folder of ``common``,
    ``server``, ``client`` or ``cli`` with an ``__init__.py`` that it does not name is left out of the wheel and
    of the image, whose processes then fail on its import, while the editable install of the tests finds it."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {f"wafl.{root}": REPO / root for root in ("common", "server", "client", "cli")}
    assert {name: str(path) for name, path in folders.items()} == {
        name: str(REPO / where) for name, where in setuptools["package-dir"].items()
    }
    on_disk = {
        ".".join([name, *init.parent.relative_to(path).parts])
        for name, path in folders.items()
        for init in path.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "pyproject.toml names packages that have no folder"
