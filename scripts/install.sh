#!/usr/bin/env bash
# Create .venv and install the pinned stack. Re-running is a no-op once the stamp is current.
#
# Why a script and not `pip install -e .`: torchrec's own metadata pulls the CUDA build of
# fbgemm-gpu, which overwrites fbgemm-gpu-cpu in the same fbgemm_gpu/ folder and then fails to
# import (libtorch_cuda.so). So torchrec goes in with --no-deps, after its real runtime deps.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.installed"
# The stamp records this file's hash, so editing the pins re-runs the install.
WANT=$(sha256sum "$0" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM="fbgemm-gpu==1.8.0"   # CUDA machine (needs a CUDA build of torch 2.13.0)
else
  FBGEMM="fbgemm-gpu-cpu==1.8.0"
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
echo "[install] torch 2.13.0, $FBGEMM, torchserve 0.12.0 into $VENV (first run takes a few minutes)"
"${PIP[@]}" torch==2.13.0 "$FBGEMM" \
  pyre-extensions tensordict torchmetrics tqdm iopath
"${PIP[@]}" --no-deps torchrec==1.8.0
# The kit itself (pulls torchserve, archiver, pyyaml, msgspec, test deps; torch is already satisfied).
"${PIP[@]}" -e ".[test]"
"$VENV/bin/python" - <<'PY'
import torch, torchrec, fbgemm_gpu, ts, model_archiver  # noqa: F401  fail here, not at serve time
print(f"[install] ok: torch {torch.__version__}, torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '1.8.0'}")
PY
echo "$WANT" > "$STAMP"
