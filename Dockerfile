# The kit's image: deploy/kserve's ServingRuntimes run it. Build it with `make image`
# (docs/kubernetes.md). Plain Dockerfile, no BuildKit features: Debian's docker.io 20.10 builds it.
# Two front doors on the same model: TorchServe (the default command) and, with the command
# `kserve [ARG...]`, KServe's own model server (dlrm_kserve.py; scripts/container_entrypoint.py).
#
# Build arguments:
#   BASE     a Debian bookworm image (default debian:bookworm-slim)
#   VARIANT  cpu (fbgemm-gpu-cpu, torch's CPU build) or cuda (fbgemm-gpu, PyPI's CUDA torch)
#   PIP_EXTRA_INDEX_URL  where pip finds the CPU torch without a wheelhouse, e.g.
#            https://download.pytorch.org/whl/cpu
# Build context folder build/docker/ (filled by `make image`):
#   wheelhouse/  wheels of scripts/install.sh's pins (install.sh --wheelhouse); empty = pip
#                fetches from its index inside the build
#   ca.pem       an extra CA bundle for pip (an intercepting proxy's), used in the build stage only
#   plugins/     the kit's built TorchServe plugin jar (build/plugins/dlrm-oip.jar, `make plugin`):
#                the default model's layout and the final image's /opt/dlrm/plugins carry it
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS build
# The labels let `make image` drop the images a rebuild supersedes (Makefile, image).
LABEL dlrmkit.stage=build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ARG VARIANT=cpu
ARG PIP_EXTRA_INDEX_URL=
# Dependencies first, the kit's code last: a code change rebuilds only the layers after this one.
COPY build/docker/ /ctx/
COPY scripts/install.sh /src/scripts/install.sh
COPY pyproject.toml /src/pyproject.toml
RUN set -eu; cd /src; \
    if [ -s /ctx/ca.pem ]; then export PIP_CERT=/ctx/ca.pem; fi; \
    if [ -n "$(ls /ctx/wheelhouse 2>/dev/null)" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/ctx/wheelhouse; fi; \
    VENV=/opt/venv KIT=runtime VARIANT=${VARIANT} PYTHON=python3 bash scripts/install.sh; \
    rm /opt/venv/.installed; find /opt/venv -name __pycache__ -prune -exec rm -rf {} +; \
    /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib > /dev/null || true
COPY *.py model-config.yaml metrics.yaml /src/
COPY dlrmkit/ /src/dlrmkit/
COPY scripts/ /src/scripts/
# The OIP endpoint plugin (`make plugin`, copied here by `make image`): the layout carries it.
COPY build/docker/plugins/ /src/build/plugins/
# The second door: dlrm_kserve.py beside the kit it imports (python /opt/dlrm/dlrm_kserve.py puts
# /opt/dlrm on sys.path), compiled here: the final image writes no bytecode.
RUN mkdir -p /opt/dlrm/door && cp -r /src/dlrm_kserve.py /src/dlrmkit /opt/dlrm/door/ \
    && find /opt/dlrm/door -name __pycache__ -prune -exec rm -rf {} + \
    && /opt/venv/bin/python -m compileall -q /opt/dlrm/door > /dev/null
# The default model: seeded weights, served on 8080 by `docker run -p 8080:8080 IMAGE`.
# The cuda variant has none: building it imports fbgemm-gpu, which needs the GPU node's driver.
RUN cd /src && export PYTHONPATH=/src && if [ "${VARIANT}" = cuda ]; then mkdir -p /opt/dlrm/model; else \
      /opt/venv/bin/python scripts/kserve_deploy.py layout --out /opt/dlrm/model \
      --mount /opt/dlrm/model --port 8080 --config model-config.yaml; fi

FROM ${BASE}
LABEL dlrmkit.stage=image
# g++ and python3-dev: a reduced-precision dense half (handler.dense_precision bf16/int8) is compiled
# by Inductor at worker start for the CPU it runs on: C++ kernels built as Python extensions (omp.h,
# Python.h). Compiled on the serving CPU rather than carried, so an image serves on any x86 host.
RUN apt-get update && apt-get install -y --no-install-recommends python3 openjdk-17-jre-headless tini \
    g++ python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin model-server
COPY --from=build /opt/venv /opt/venv
COPY build/docker/plugins/ /opt/dlrm/plugins/
COPY --from=build /opt/dlrm/door/ /opt/dlrm/
COPY scripts/container_entrypoint.py /opt/dlrm/entrypoint.py
COPY --from=build /opt/dlrm/model /opt/dlrm/model
# OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep rather than spin on a core another worker or the
# frontend needs (a worker of handler.torch_threads > 1 runs OpenMP threads; docs/performance.md).
# Only /tmp is writable under Kubernetes' readOnlyRootFilesystem (an emptyDir): TorchServe's
# logs/ and snapshots, its pid file and the workers' sockets and model folders all go there; the
# second door unpacks its .mar into a temporary directory there (TMPDIR).
ENV PATH=/opt/venv/bin:$PATH HOME=/tmp TMPDIR=/tmp LOG_LOCATION=/tmp/logs METRICS_LOCATION=/tmp/logs \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
WORKDIR /tmp
USER 1000:1000
# 8080: the default model's HTTP (either door); 8081: the second door's gRPC; 8085, 7070, 8082:
# TorchServe on a ServingRuntime's layout (HTTP, gRPC, metrics).
EXPOSE 8080 8081 8085 7070 8082
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/venv/bin/python", "/opt/dlrm/entrypoint.py"]
CMD ["torchserve", "--start", "--foreground", "--model-store=/opt/dlrm/model/model-store", \
     "--ts-config=/opt/dlrm/model/config/config.properties"]
