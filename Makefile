# The DLRM serving kit. Quick start: `make serve`, then `make test`.
PY      := .venv/bin/python
CONFIG  ?= model-config.yaml
PROPS   ?= config.properties
MAR     := model_store/dlrm.mar
SOURCES := dlrm_handler.py dlrm_factory.py dlrm_core.py dlrm_config.py dlrm_errors.py dlrm_scale.py dlrm_kserve.py scripts/build_mar.py

.PHONY: venv mar serve ready rollout rollback stop test unit integration bench soak clean FORCE

# Creates .venv and installs the pinned stack; a no-op once done (see scripts/install.sh).
venv:
	@bash scripts/install.sh

# Rebuilt when a source or the config changes; CONFIG=model-config.criteo.yaml for Criteo.
$(MAR): $(SOURCES) $(CONFIG) model_store/.config | venv
	$(PY) scripts/build_mar.py --config $(CONFIG) --force

# Records which config the archive was built from, so switching CONFIG rebuilds it.
model_store/.config: FORCE
	@mkdir -p model_store; echo "$(CONFIG)" | cmp -s - $@ || echo "$(CONFIG)" > $@

FORCE:

mar: venv
	$(PY) scripts/build_mar.py --config $(CONFIG) --force

# Start TorchServe in the background (logs/), wait for the model, score a sample request.
serve: venv $(MAR)
	$(PY) scripts/serve.py start --properties $(PROPS) \
	  $(if $(filter model-config.criteo.yaml,$(CONFIG)),--sample sample_requests/criteo.json)

# Readiness probe of the server `make serve` started: exit 0 once the model scores a request.
ready:
	$(PY) scripts/serve.py ready \
	  $(if $(filter model-config.criteo.yaml,$(CONFIG)),--sample sample_requests/criteo.json)

# Build the next model version from CONFIG and roll it out with no downtime (README, Operations).
rollout: venv
	$(PY) scripts/rollout.py --config $(CONFIG) \
	  $(if $(filter model-config.criteo.yaml,$(CONFIG)),--sample sample_requests/criteo.json)

rollback: venv
	$(PY) scripts/rollout.py --rollback \
	  $(if $(filter model-config.criteo.yaml,$(CONFIG)),--sample sample_requests/criteo.json)

stop: venv
	$(PY) scripts/serve.py stop --properties $(PROPS)

test: venv
	$(PY) -m pytest -q

unit: venv
	$(PY) -m pytest -q -m "not integration"

integration: venv
	$(PY) -m pytest -q -m integration

# Benchmark (results/benchmark.{json,md,png}); see README "Performance". ~3-5 minutes.
bench: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/benchmark.py

# Mixed good/bad load against a private TorchServe; every answer checked. See README.
soak: venv $(MAR)
	$(PY) scripts/soak.py --duration 600 --concurrency 64 --json results/soak.json

clean: stop
	rm -rf model_store .serve logs
