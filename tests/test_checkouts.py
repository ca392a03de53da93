"""scripts/venv.sh: every checkout runs its own code.

Two clones of this repository at different commits each get their environment from
``scripts/venv.sh`` (the dependencies shared outside the clones, the project's editable install
inside each clone); each must import its own modules and run its own ``wafl`` console script, also
after the other clone's environment was made or refreshed, as a frozen worktree running a long sweep
beside a clone being edited does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = "WAFL_CHECKOUT_MARK"

pytestmark = pytest.mark.slow


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _clone(tmp: Path, name: str, mark: str) -> Path:
    """A clone of this repository's HEAD with one more commit that gives ``wafl.common`` a marker."""
    dest = tmp / name
    _git(tmp, "clone", "--quiet", "--no-hardlinks", str(REPO), str(dest))
    init = dest / "common" / "__init__.py"
    init.write_text(init.read_text() + f'\n{MARK} = "{mark}"\n')
    _git(dest, "commit", "--quiet", "-am", f"mark {mark}")
    return dest


def _venv(clone: Path) -> Path:
    out = subprocess.run(["bash", "scripts/venv.sh"], cwd=clone, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _imports(venv: Path) -> tuple[str, str]:
    """The marker and the file of ``wafl.common`` as the environment's interpreter imports them."""
    code = f"import wafl.common as c; print(getattr(c, {MARK!r}, '-')); print(c.__file__)"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    mark, path = out.stdout.split()
    return mark, path


def _script_interpreter(venv: Path, script: str) -> str:
    return (venv / "bin" / script).read_text().splitlines()[0].removeprefix("#!")


def test_two_clones_at_different_commits_each_run_their_own_code(tmp_path: Path) -> None:
    a = _clone(tmp_path, "a", "a")
    b = _clone(tmp_path, "b", "b")
    assert _git(a, "rev-parse", "HEAD") != _git(b, "rev-parse", "HEAD")
    venv_a = _venv(a)
    venv_b = _venv(b)  # made after a's: under one shared editable install it would take a's place
    assert venv_a != venv_b
    for clone, venv, mark in ((a, venv_a, "a"), (b, venv_b, "b")):
        got_mark, path = _imports(venv)
        assert got_mark == mark
        assert Path(path).resolve().is_relative_to(clone.resolve())
        # the console scripts run the checkout's own interpreter: wafl, and the test tools that import it
        for script in ("wafl", "pytest", "lint-imports"):
            assert _script_interpreter(venv, script) == str(venv / "bin" / "python")
    # refreshing a's environment (every `make` does) leaves b's on b's code, and the other way round
    _venv(a)
    assert _imports(venv_b)[0] == "b"
    _venv(b)
    assert _imports(venv_a)[0] == "a"
    # the console script imports its own checkout too
    out = subprocess.run([str(venv_a / "bin" / "wafl"), "--help"], check=True, capture_output=True, text=True)
    assert "usage: wafl" in out.stdout
    # the shared dependencies hold no wafl of any checkout
    deps = Path((venv_a / ".deps").read_text().strip())
    assert deps == Path((venv_b / ".deps").read_text().strip())
    found = subprocess.run(
        [str(deps / "bin" / "python"), "-c", "import importlib.util as u; print(u.find_spec('wafl'))"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert found.stdout.strip() == "None"
