# The DLRM serving kit. Quick start: `make serve`, then `make test`; `make help` lists the targets.
PY      := .venv/bin/python
CONFIG  ?= model-config.yaml
PROPS   ?= config.properties
MAR     := model_store/dlrm.mar
# The request that probes readiness: sample_requests/<name>.json for model-config.<name>.yaml
# when it exists (criteo, dlrmv2), else one serve.py builds from CONFIG's layout; SAMPLE=FILE overrides.
SAMPLE  ?= $(wildcard $(patsubst model-config.%.yaml,sample_requests/%.json,$(filter model-config.%.yaml,$(notdir $(CONFIG)))))
SAMPLE_ARG = $(if $(SAMPLE),--sample $(SAMPLE))
PROBE_ARG  = $(if $(SAMPLE),--sample $(SAMPLE),--config $(CONFIG))
SOURCES := dlrm_handler.py $(wildcard dlrmkit/*.py dlrmkit/*/*.py) scripts/build_mar.py
# A trained checkpoint to serve (docs/trained-models.md): a .pt/.pth file or a DCP directory,
# whose files the archive then depends on.
CHECKPOINT ?=
# Requests with the trainer's own scores (JSON lines; scripts/train.py writes verify.jsonl): the
# build proves the archive against them and fails, leaving no archive, on any difference.
VERIFY ?=
VERIFY_ARG = $(if $(VERIFY),--verify $(VERIFY))
# handler.dense_precision int8: requests like the training data (scripts/train.py writes
# calibration.jsonl) for static activation scales; without it int8 scales per batch (dynamic).
CALIBRATE ?=
CALIBRATE_ARG = $(if $(CALIBRATE),--calibrate $(CALIBRATE))
CKPT_FILES := $(if $(CHECKPOINT),$(or $(wildcard $(CHECKPOINT)/.metadata $(CHECKPOINT)/*),$(CHECKPOINT)))

.PHONY: help venv plugin image image-base mar serve ready rollout rollback stop lint fuzz test unit integration test-gpu bench knobs soak faults clean FORCE

# Creates .venv and installs the pinned stack; a no-op once done (see scripts/install.sh).
venv:  ## create .venv with the pinned stack (a no-op once done)
	@bash scripts/install.sh

# One line per target, from the `## ` comment after it (tests/test_docs.py checks every target has one).
help:  ## list the targets
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /\1\t/' | awk -F'\t' '{printf "  %-12s %s\n", $$1, $$2}'

# Rebuilt when a source, the config or the checkpoint changes; CONFIG=model-config.criteo.yaml for
# Criteo, CONFIG=model-config.dlrmv2.yaml for MLPerf DLRMv2.
$(MAR): $(SOURCES) $(CONFIG) $(CKPT_FILES) $(VERIFY) $(CALIBRATE) model_store/.config | venv
	$(PY) scripts/build_mar.py --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(VERIFY_ARG) $(CALIBRATE_ARG) --force

# Records which config and checkpoint the archive was built from, so switching either rebuilds it.
model_store/.config: FORCE
	@mkdir -p model_store; echo "$(CONFIG) $(CHECKPOINT) $(CALIBRATE)" | cmp -s - $@ || echo "$(CONFIG) $(CHECKPOINT) $(CALIBRATE)" > $@

FORCE:

# The Open Inference Protocol endpoints (health, metadata, readiness, model config) run inside
# TorchServe's frontend JVM as an endpoint plugin: Java compiled here against the frontend jar in
# the torchserve wheel (no Maven); config.properties' plugins_path points at build/plugins.
PLUGIN     := build/plugins/dlrm-oip.jar
PLUGIN_SRC := $(wildcard plugin/src/dlrmkit/oip/*.java) plugin/META-INF/services/org.pytorch.serve.servingsdk.ModelServerEndpoint
$(PLUGIN): $(PLUGIN_SRC) | venv
	@rm -rf build/oip && mkdir -p build/oip/classes $(@D)
	javac --release 17 -Xlint:all,-processing -Werror -d build/oip/classes \
	  -cp "$$(ls .venv/lib/python3*/site-packages/ts/frontend/model-server.jar)" $(filter %.java,$^)
	jar cf $@ -C build/oip/classes . -C plugin META-INF

plugin: $(PLUGIN)  ## build the Open Inference Protocol endpoint plugin (build/plugins/dlrm-oip.jar)

mar: venv $(PLUGIN)  ## build model_store/dlrm.mar from CONFIG (and CHECKPOINT, proven with VERIFY)
	$(PY) scripts/build_mar.py --config $(CONFIG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(VERIFY_ARG) $(CALIBRATE_ARG) --force

# Start TorchServe in the background (logs/), wait for the model, score a sample request.
serve: venv $(MAR) $(PLUGIN)  ## start TorchServe in the background, wait for the model, score a sample
	$(PY) scripts/serve.py start --properties $(PROPS) $(PROBE_ARG)

# Readiness probe of the server `make serve` started: exit 0 once the model scores a request.
ready:  ## readiness probe: exit 0 once the served model scores a request
	$(PY) scripts/serve.py ready $(PROBE_ARG)

# Build the next model version from CONFIG and roll it out with no downtime (docs/operations.md).
rollout: venv  ## build the next version from CONFIG and roll it out with no downtime
	$(PY) scripts/rollout.py --config $(CONFIG) $(SAMPLE_ARG) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(VERIFY_ARG) $(CALIBRATE_ARG)

rollback: venv  ## roll back to the previous model version
	$(PY) scripts/rollout.py --rollback $(SAMPLE_ARG)

stop: venv  ## stop the server `make serve` started
	$(PY) scripts/serve.py stop --properties $(PROPS)

# The image deploy/kserve names (docs/kubernetes.md). VARIANT=cuda for the gpu overlay's tag.
# WHEELHOUSE=1 (default): wheels of scripts/install.sh's pins made on this host (its pip's index,
# proxy and CA settings); WHEELHOUSE=DIR: wheels prepared elsewhere (install.sh --wheelhouse DIR);
# WHEELHOUSE=0: pip fetches inside the build (PIP_EXTRA_INDEX_URL=..., PIP_CA=extra-CA.pem).
VARIANT ?= cpu
IMAGE   ?= ghcr.io/example/dlrm-torchserve:0.1.0-$(if $(filter cuda,$(VARIANT)),gpu,cpu)
BASE    ?= debian:bookworm-slim
BUILD_CACHE ?= dlrmkit-build-cache:$(VARIANT)
IMAGE_ARGS = --build-arg BASE=$(BASE) --build-arg VARIANT=$(VARIANT) \
  --build-arg PIP_EXTRA_INDEX_URL=$(PIP_EXTRA_INDEX_URL)
WHEELHOUSE ?= 1
PIP_CA  ?=
# The base first: a missing mmdebstrap stops the build before minutes of wheels (scripts/base_image.sh).
image-base:  ## make sure BASE exists and runs /bin/sh (kept, pulled, or made with mmdebstrap)
	@bash scripts/base_image.sh $(BASE)

image: image-base $(PLUGIN)  ## build the container image deploy/kserve runs (VARIANT=cpu|cuda)
	@[ "$$(cat build/docker/.variant 2>/dev/null)" = "$(VARIANT)" ] || rm -rf build/docker
	@mkdir -p build/docker/plugins build/docker/wheelhouse && echo $(VARIANT) > build/docker/.variant
	@case "$(WHEELHOUSE)" in \
	  1) VARIANT=$(VARIANT) bash scripts/install.sh --wheelhouse build/docker/wheelhouse ;; \
	  0) rm -rf build/docker/wheelhouse/* ;; \
	  *) rm -rf build/docker/wheelhouse && cp -r "$(WHEELHOUSE)" build/docker/wheelhouse ;; \
	esac
	@cp $(PLUGIN) build/docker/plugins/
	@if [ -n "$(PIP_CA)" ]; then cp "$(PIP_CA)" build/docker/ca.pem; else : > build/docker/ca.pem; fi
	@# The build stage is tagged too (BUILD_CACHE, the next build's cache). Each rebuild leaves the
	@# images it replaced untagged, ~4 GB a build: ours (the Dockerfile's labels) are dropped.
	docker build --target build -t $(BUILD_CACHE) $(IMAGE_ARGS) .
	docker build -t $(IMAGE) $(IMAGE_ARGS) .
	@docker image prune -f --filter label=dlrmkit.stage >/dev/null

# Checks before review: ruff's lint and its formatter (--check) over the whole tree, mypy over the
# kit and the handler with no per-module disables (pyproject.toml).
lint: venv  ## ruff (lint, format) and mypy, as CI runs them before the tests
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Coverage-guided fuzzing of the network-facing parsers (scripts/fuzz.py; make test runs a short
# seeded pass): every target for FUZZ_MINUTES each, figures to results/fuzz.{json,md}.
FUZZ_MINUTES ?= 13
fuzz: venv  ## fuzz the request parsers, FUZZ_MINUTES per target (results/fuzz.*), ~1 hour
	nice -n 15 $(PY) scripts/fuzz.py campaign --minutes $(FUZZ_MINUTES)

test: venv $(PLUGIN)  ## all tests but the GPU ones: unit and real-TorchServe integration
	$(PY) -m pytest -q

unit: venv  ## unit tests only (no TorchServe, no container)
	$(PY) -m pytest -q -m "not integration and not container and not gpu"

integration: venv $(PLUGIN)  ## integration tests only (real TorchServe)
	$(PY) -m pytest -q -m integration

test-gpu: venv  ## the GPU tests only (tables on 1 and 2 CUDA devices); they fail without the devices
	$(PY) -m pytest -q -m gpu

# Every scenario writes a run's own folder, results/<date>-<scenario>/, with its run.json (bench/common.py
# run_dir; --out DIR elsewhere). Benchmark, then MLPerf's Server scenario under LoadGen (LoadGen's
# summaries in its loadgen/); see docs/performance.md. ~45 minutes on 2 vCPUs (the Server scenario ~33).
bench: venv $(PLUGIN)  ## the benchmark and the Server scenario under MLPerf LoadGen (results/<date>-benchmark/, -server-scenario/), ~45 minutes
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/benchmark.py
	$(PY) bench/server_scenario.py

# TorchServe's netty/queue/batching settings, A/B against the shipped ones.
knobs: venv $(PLUGIN)  ## measure TorchServe's settings against the shipped ones (results/<date>-knobs/), ~10 minutes
	$(PY) bench/knobs.py

# Mixed good/bad load against a private TorchServe; every answer checked. See docs/faults-and-soak.md.
soak: venv $(MAR) $(PLUGIN)  ## 10-minute mixed good/bad load, every answer checked (results/<date>-soak/)
	$(PY) bench/soak.py --duration 600 --concurrency 64

# Kill, hang, restart, flood and starve a private TorchServe under load; every answer checked
# (results/<date>-faults/); see docs/faults-and-soak.md. Up to 10 minutes; root for the logs tmpfs.
faults: venv $(PLUGIN)  ## break a private TorchServe under load (results/<date>-faults/), up to 10 minutes
	$(PY) bench/faults.py

clean: stop  ## stop, then remove model_store/, .serve/ and logs/
	rm -rf model_store .serve logs
