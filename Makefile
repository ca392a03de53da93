# Two entry points that work on a fresh machine: `make run` and `make test`.
# scripts/venv.sh prints this checkout's environment (.venv, its own editable install) over dependencies shared
# outside the clone, keyed by the dependency list; it creates what is missing.
VENV := $(shell bash scripts/venv.sh)
ifeq ($(VENV),)
$(error scripts/venv.sh could not create the virtual environment; run it by hand to see why)
endif

.PHONY: run test docs protos bench

run:  ## a whole federation on the embedded digits data (a server and the 10 clients in workers, over gRPC)
	bash scripts/datasets.sh $(ARGS)  # installs Fashion-MNIST when ARGS ask for it and it is missing
	$(VENV)/bin/wafl run $(ARGS)

test:  ## style (ruff), the layer contract (lint-imports), the types (mypy), the docs build, then the whole test suite
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports  # pyproject.toml's [tool.importlinter]: cli > server | client > common, the rooms of cli, no import cycle
	bash scripts/typecheck.sh $(VENV)/bin/python  # mypy over common, server, client, cli: [tool.mypy]
	$(VENV)/bin/mkdocs build --strict --quiet  # docs/: a broken link, an unlisted page or an unresolved API reference fails
	bash scripts/node_modules.sh >/dev/null  # the Node.js conformance client's npm packages (cached outside the clone)
	bash scripts/datasets.sh fashion-mnist  # the tests read the real Fashion-MNIST files
	bash scripts/compose_cli.sh  # the compose files' tests resolve them through docker-compose
	$(VENV)/bin/python -m pytest -q $(ARGS)

docs:  ## the documentation site (docs/ -> build/site)
	$(VENV)/bin/mkdocs build --strict

protos:  ## regenerate common/proto from protos/
	$(VENV)/bin/python -m wafl.common.protogen

bench:  ## transport benchmark (writes benchmarks/results/transport.json)
	$(VENV)/bin/python benchmarks/transport.py
