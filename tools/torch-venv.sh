#!/usr/bin/env bash
# The virtual environment of the PyTorch tests (tests/torch): .venv-torch.
#
# torch is PyPI's torch==2.15.0 (pinned: torch.distributed.checkpoint with checkpoint_id,
# async_save and FSDP2's fully_shard, which matrixpool_recovery.torch and its tests need) for
# the project's Python (python3 on PATH, or $PYTHON), with its dependencies (the CUDA
# libraries, ~2.8 GB: the same wheel runs on CPU, where the tests run, and on a GPU), NumPy,
# pytest and the project installed editable.
#
# Every wheel is downloaded once into ~/.cache/matrixpool/wheels ($MATRIXPOOL_WHEELS) with
# `pip download`, then installed from there with `pip install --no-index --find-links`: a warm
# run (the wheels there already) downloads nothing. Progress goes to stderr.
#
# Called by the Makefile (then `.venv-torch/bin/pytest tests/torch -q`). Idempotent: a stamp
# records the pyproject.toml and this script it installed for; run again when they change.
set -euo pipefail
script=$(realpath "$0")
cd "$(dirname "$script")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-torch
STAMP=$VENV/.installed
WHEELS=${MATRIXPOOL_WHEELS:-$HOME/.cache/matrixpool/wheels}
TORCH=torch==2.15.0
# What the venv holds beside the project: torch, the client's NumPy, the test runner, and the
# build backend of the editable install (build isolation finds it in the wheel folder too).
REQUIREMENTS=("$TORCH" 'numpy>=1.26' 'pytest>=8' 'pytest-timeout>=2.3' 'setuptools>=77.0.3' wheel)
wanted=$(cat pyproject.toml "$script" | sha256sum | cut -d' ' -f1)

say() { echo "torch-venv: $*" >&2; }

if [[ -f $STAMP && $(cat "$STAMP") == "$wanted" ]] &&
  "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  exit 0
fi

# 1. The venv, of the project's Python (no system site packages: nothing of Debian's).
if [[ -x $VENV/bin/python ]] &&
  ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) or sys.prefix == sys.base_prefix or "dist-packages" in str(sys.path))'; then
  say "replacing $VENV (another Python, or Debian's system site packages)"
  rm -rf "$VENV"
fi
if [[ ! -x $VENV/bin/python ]]; then
  say "creating $VENV with $("$PYTHON" --version) ($(command -v "$PYTHON"))"
  "$PYTHON" -m venv "$VENV"
fi
echo '*' >"$VENV/.gitignore" # the venv ignores itself
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

# 2. The wheels: the project's dependencies and the requirements, downloaded only when the
#    wheel folder cannot satisfy them already (a dry run without an index says so).
mkdir -p "$WHEELS"
offline=("${pip[@]}" install --no-index --find-links "$WHEELS")
if "${offline[@]}" --dry-run --quiet "${REQUIREMENTS[@]}" -e . >/dev/null 2>&1; then
  say "every wheel is in $WHEELS already"
else
  say "downloading the wheels into $WHEELS (torch's CUDA dependencies: ~2.8 GB the first time)"
  "${pip[@]}" download --progress-bar off --quiet --dest "$WHEELS" "${REQUIREMENTS[@]}" .
  rm -f "$WHEELS"/matrixpool-*  # the project itself, if pip saved it: installed from here
fi

# 3. Install from the folder alone.
say "installing $TORCH, NumPy, pytest and the project (editable) from $WHEELS"
"${offline[@]}" --quiet "${REQUIREMENTS[@]}" -e .
"$VENV/bin/python" -c 'import sys, torch, torch.distributed as dist, numpy, matrixpool_recovery
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.fsdp import fully_shard
assert dist.is_gloo_available(), "this torch has no gloo"
print(f"torch-venv: torch {torch.__version__}, numpy {numpy.__version__}, "
      f"Python {sys.version.split()[0]}", file=sys.stderr)'
echo "$wanted" >"$STAMP"
