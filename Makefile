# The DLRM serving kit. Quick start: `make serve`, then `make test`.
PY      := .venv/bin/python
CONFIG  ?= model-config.yaml
PROPS   ?= config.properties
MAR     := model_store/dlrm.mar
# The request that probes readiness: sample_requests/<name>.json for model-config.<name>.yaml
# when it exists (criteo, dlrmv2), else serve.py's default (the seed layout's); SAMPLE=FILE overrides.
SAMPLE  ?= $(wildcard $(patsubst model-config.%.yaml,sample_requests/%.json,$(filter model-config.%.yaml,$(notdir $(CONFIG)))))
SAMPLE_ARG = $(if $(SAMPLE),--sample $(SAMPLE))
SOURCES := dlrm_handler.py dlrm_factory.py dlrm_core.py dlrm_config.py dlrm_errors.py dlrm_scale.py dlrm_kserve.py dlrm_checkpoint.py \
           scripts/build_mar.py
# A trained checkpoint to serve (docs/trained-models.md): a .pt/.pth file or a DCP directory,
# whose files the archive then depends on.
CHECKPOINT ?=
CKPT_FILES := $(if $(CHECKPOINT),$(or $(wildcard $(CHECKPOINT)/.metadata $(CHECKPOINT)/*),$(CHECKPOINT)))

.PHONY: venv mar serve ready rollout rollback stop test unit integration bench soak faults clean FORCE

# Creates .venv and installs the pinned stack; a no-op once done (see scripts/install.sh).
venv:
	@bash scripts/install.sh

# Rebuilt when a source, the config or the checkpoint changes; CONFIG=model-config.criteo.yaml for
# Criteo, CONFIG=model-config.dlrmv2.yaml for MLPerf DLRMv2.
$(MAR): $(SOURCES) $(CONFIG) $(CKPT_FILES) model_store/.config | venv
	$(PY) scripts/build_mar.py --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) --force

# Records which config and checkpoint the archive was built from, so switching either rebuilds it.
model_store/.config: FORCE
	@mkdir -p model_store; echo "$(CONFIG) $(CHECKPOINT)" | cmp -s - $@ || echo "$(CONFIG) $(CHECKPOINT)" > $@

FORCE:

mar: venv
	$(PY) scripts/build_mar.py --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) --force

# Start TorchServe in the background (logs/), wait for the model, score a sample request.
serve: venv $(MAR)
	$(PY) scripts/serve.py start --properties $(PROPS) $(SAMPLE_ARG) $(if $(CHECKPOINT),--config $(CONFIG))

# Readiness probe of the server `make serve` started: exit 0 once the model scores a request.
ready:
	$(PY) scripts/serve.py ready $(SAMPLE_ARG) $(if $(CHECKPOINT),--config $(CONFIG))

# Build the next model version from CONFIG and roll it out with no downtime (docs/operations.md).
rollout: venv
	$(PY) scripts/rollout.py --config $(CONFIG) $(SAMPLE_ARG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT))

rollback: venv
	$(PY) scripts/rollout.py --rollback $(SAMPLE_ARG)

stop: venv
	$(PY) scripts/serve.py stop --properties $(PROPS)

test: venv
	$(PY) -m pytest -q

unit: venv
	$(PY) -m pytest -q -m "not integration"

integration: venv
	$(PY) -m pytest -q -m integration

# Benchmark (results/benchmark.{json,md,png}); see docs/performance.md. ~3-5 minutes.
bench: venv
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/benchmark.py

# Mixed good/bad load against a private TorchServe; every answer checked. See docs/faults-and-soak.md.
soak: venv $(MAR)
	$(PY) bench/soak.py --duration 600 --concurrency 64 --json results/soak.json

# Kill, hang, restart, flood and starve a private TorchServe under load; every answer checked
# (results/faults.{json,md}); see docs/faults-and-soak.md. Up to 10 minutes; root for the logs tmpfs.
faults: venv
	$(PY) bench/faults.py --json results/faults.json --table results/faults.md

clean: stop
	rm -rf model_store .serve logs
