#!/usr/bin/env bash
# The virtual environment of the PyTorch tests (tests/torch): .venv-torch.
#
# torch comes from Debian (python3-torch 1.13, CPU build with gloo) for Debian's own Python,
# /usr/bin/python3; the venv sees it, and Debian's NumPy it was built against, through
# --system-site-packages, and gets the project installed editable on top. The dev extra is not
# installed: its numpy>=1.26 would pull a PyPI NumPy that Debian's torch cannot use (another
# ABI), so NumPy is held at Debian's version by a constraint.
#
# Called by the Makefile (then `.venv-torch/bin/pytest tests/torch -q`). Idempotent: a stamp
# records the pyproject.toml and this script it installed for; run again when they change.
set -euo pipefail
script=$(realpath "$0")
cd "$(dirname "$script")/.."

PYTHON=/usr/bin/python3
VENV=.venv-torch
STAMP=$VENV/.installed
wanted=$(cat pyproject.toml "$script" | sha256sum | cut -d' ' -f1)

if [[ -f $STAMP && $(cat "$STAMP") == "$wanted" ]] &&
  "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  exit 0
fi

# 1. Debian's torch and venv, unless Debian's Python has them already.
if ! "$PYTHON" -c 'import torch, ensurepip' 2>/dev/null; then
  echo "torch-venv: installing Debian packages python3-torch python3-venv (apt-get)" >&2
  if ! command -v apt-get >/dev/null; then
    echo "torch-venv: no apt-get here: install torch (CPU, with gloo) for $PYTHON yourself" >&2
    exit 1
  fi
  if [[ $(id -u) != 0 ]]; then
    echo "torch-venv: $PYTHON cannot import torch and apt-get needs root:" \
      "run 'apt-get install python3-torch python3-venv' as root, then this again" >&2
    exit 1
  fi
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    python3-torch python3-venv
fi

# 2. The venv, seeing Debian's packages.
if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
echo '*' >"$VENV/.gitignore" # the venv ignores itself

# 3. The project and the test runner; NumPy stays Debian's. requests comes from PyPI with the
#    urllib3 2 the project's dependencies pull (Debian's requests warns about it, and pytest
#    turns warnings into errors).
numpy=$("$PYTHON" -c 'import numpy; print(numpy.__version__)')
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "numpy==$numpy" >"$constraints"
"$VENV/bin/python" -m pip install --quiet --constraint "$constraints" \
  -e . 'pytest>=8' 'pytest-timeout>=2.3' 'requests>=2.32'
"$VENV/bin/python" -c 'import torch, torch.distributed as dist, numpy, matrixpool_recovery
assert dist.is_gloo_available(), "this torch has no gloo"
print(f"torch-venv: torch {torch.__version__}, numpy {numpy.__version__}")'
echo "$wanted" >"$STAMP"
