#!/usr/bin/env bash
# Install the pinned stack: the one place its pins live (the container image runs this script too).
#
#   bash scripts/install.sh                      # .venv for development (what `make venv` runs)
#   bash scripts/install.sh --wheelhouse DIR     # wheels of the same pins into DIR, for `make image`
#   VENV=/opt/venv KIT=runtime bash scripts/install.sh   # the image: the kit's runtime deps and its door extra
#
# Why a script and not `pip install -e .`: torchrec's own metadata pulls the CUDA build of
# fbgemm-gpu, which overwrites fbgemm-gpu-cpu in the same fbgemm_gpu/ folder and then fails to
# import (libtorch_cuda.so). So torchrec goes in with --no-deps, after its real runtime deps.
# Re-running is a no-op once the stamp is current.
#
# VARIANT=cpu|cuda picks fbgemm-gpu-cpu or fbgemm-gpu (default: cuda where nvidia-smi sees a GPU).
# The CPU build of torch comes from wherever pip looks: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# (its 2.13.0+cpu outranks PyPI's CUDA 2.13.0), or a local wheel on PIP_FIND_LINKS.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
KIT=${KIT:-dev}   # dev: the kit editable with its test extras; runtime: its runtime deps and door extra

VARIANT=${VARIANT:-}
if [ -z "$VARIANT" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VARIANT=cuda; else VARIANT=cpu; fi
fi
case "$VARIANT" in
  cpu)  FBGEMM="fbgemm-gpu-cpu==1.8.0" ;;
  cuda) FBGEMM="fbgemm-gpu==1.8.0" ;;   # needs a CUDA build of torch 2.13.0 (PyPI's default)
  *) echo "[install] VARIANT=$VARIANT: expected cpu or cuda" >&2; exit 2 ;;
esac
STACK=(torch==2.13.0 "$FBGEMM" pyre-extensions tensordict torchmetrics tqdm iopath)
TORCHREC=torchrec==1.8.0
# The kit's runtime deps, from pyproject.toml (torchserve, archiver, pyyaml, msgspec, numpy).
mapfile -t KIT_DEPS < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
# The second door's (kserve), the door extra: the image serves either door.
mapfile -t DOOR_DEPS < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["door"]))')

if [ "${1:-}" = "--wheelhouse" ]; then
  OUT=${2:?usage: install.sh --wheelhouse DIR}
  mkdir -p "$OUT"
  echo "[install] wheels of torch 2.13.0 ($VARIANT), $FBGEMM, $TORCHREC, torchserve 0.12.0 into $OUT"
  # pip wheel, not pip download: sdist-only deps (iopath) become wheels here, so the image's
  # build stage installs with --no-index and needs no compiler or setuptools.
  W=("$PY" -m pip wheel --disable-pip-version-check -q -w "$OUT")
  "${W[@]}" "${STACK[@]}" "${KIT_DEPS[@]}" "${DOOR_DEPS[@]}"
  "${W[@]}" --no-deps "$TORCHREC"
  exit 0
fi

STAMP="$VENV/.installed"
# The stamp records this file's hash, so editing the pins re-runs the install.
WANT=$(sha256sum "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
[ "$KIT" = runtime ] && PIP+=(--no-cache-dir)
echo "[install] torch 2.13.0, $FBGEMM, torchserve 0.12.0 into $VENV (first run takes a few minutes)"
"${PIP[@]}" "${STACK[@]}"
"${PIP[@]}" --no-deps "$TORCHREC"
if [ "$KIT" = runtime ]; then
  "${PIP[@]}" "${KIT_DEPS[@]}" "${DOOR_DEPS[@]}"
else
  # The kit itself (pulls torchserve, archiver, pyyaml, msgspec, test deps; torch is already satisfied).
  "${PIP[@]}" -e ".[test]"
fi
if [ "$VARIANT" = cuda ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  # fbgemm-gpu's CUDA build loads the driver's libnvidia-ml at import: only a GPU node has it.
  "$VENV/bin/python" -c 'import torch, ts, model_archiver; print(f"[install] ok: torch {torch.__version__}; fbgemm_gpu/torchrec not imported: no NVIDIA driver here")'
else
"$VENV/bin/python" - <<'PY'
import torch, torchrec, fbgemm_gpu, ts, model_archiver  # noqa: F401  fail here, not at serve time
print(f"[install] ok: torch {torch.__version__}, torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '1.8.0'}")
PY
fi
echo "$WANT" > "$STAMP"
