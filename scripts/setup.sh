#!/usr/bin/env bash
# Installs what the build and the tests need and are missing:
#  1. Debian/Ubuntu packages (apt; sudo when not root): compilers, cmake,
#     ninja, the C++ libraries, python3 with its headers and venv module.
#  2. A Python virtual environment for the Python package and its tests,
#     .venv in the repository (MOEFLOW_VENV=DIR puts it, or reuses one,
#     elsewhere), made with --system-site-packages so that a torch installed
#     for the system's python is reused, holding nanobind, numpy, pytest and
#     scikit-build-core (pip). It is always used, not only where the system
#     python is externally managed (PEP 668): one interpreter, the same on
#     every machine, and nothing is ever pip-installed into the system's.
#     scripts/build.sh and scripts/test.sh use its python.
#  3. torch (pip, from PyPI, into that environment) when the environment
#     cannot import one already: moeflow.ops, moeflow.MoELayer, their tests
#     and the torch examples need it (about 4 GB with its CUDA libraries).
#     MOEFLOW_INSTALL_TORCH=0 leaves it out: those tests are then reported
#     as skipped.
#  4. megatron-core's sources (pip, into .venv/mcore) for the tests of
#     moeflow.megatron; MOEFLOW_INSTALL_MEGATRON=0 leaves them out.
# The CUDA toolkit (nvcc on PATH or /usr/local/cuda/bin) is used when present;
# MOEFLOW_WITH_CUDA=OFF forces the CPU backend (read by CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libfmt-dev
      python3 python3-dev python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing (apt): ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

venv="${MOEFLOW_VENV:-$PWD/.venv}"
python="${MOEFLOW_PYTHON:-python3}"  # the interpreter the environment is made from
if ! "$venv/bin/python" -c "import sys" >/dev/null 2>&1; then
  if [ -n "$(ls -A "$venv" 2>/dev/null)" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "setup: $venv exists and is not a Python virtual environment; move it or set MOEFLOW_VENV" >&2
    exit 1
  fi
  echo "setup: creating the Python environment $venv ($("$python" -c 'import sys; print(sys.executable, sys.version.split()[0])'), --system-site-packages)"
  "$python" -m venv --clear --system-site-packages "$venv"  # --clear: remakes a broken one
fi
py="$venv/bin/python"
want=(nanobind numpy pytest scikit_build_core)
need=()
for m in "${want[@]}"; do
  "$py" -c "import $m" >/dev/null 2>&1 || need+=("${m//_/-}")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing (pip, into $venv): ${need[*]}"
  "$py" -m pip install --quiet --disable-pip-version-check --no-input "${need[@]}"
fi
"$py" -c "import nanobind, numpy, pytest, scikit_build_core" # fails loudly if pip did not manage
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  if [ "${MOEFLOW_INSTALL_TORCH:-1}" = 0 ]; then
    echo "setup: MOEFLOW_INSTALL_TORCH=0: torch not installed"
  else
    echo "setup: installing (pip, into $venv): torch (about 4 GB with its CUDA libraries;" \
         "MOEFLOW_INSTALL_TORCH=0 leaves it out)"
    "$py" -m pip install --quiet --disable-pip-version-check --no-input torch
    "$py" -c "import torch"  # fails loudly if pip did not manage
  fi
fi
# megatron-core (its pure-Python sources, no dependencies) for the tests of
# moeflow.megatron, into $venv/mcore (scripts/test.sh puts it on the path).
# Its wheels say Python 3.12+ and cp312; the tests need only its sources.
mcore="$venv/mcore"
if [ "${MOEFLOW_INSTALL_MEGATRON:-1}" = 1 ] && [ ! -d "$mcore/megatron/core" ] &&
   "$py" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing megatron-core 0.19.2 (sources, into $mcore; MOEFLOW_INSTALL_MEGATRON=0 leaves it out)"
  "$py" -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
      --ignore-requires-python --python-version 3.12 --implementation cp --only-binary=:all: \
      --platform manylinux_2_28_x86_64 --target "$mcore" megatron-core==0.19.2 ||
    echo "setup: megatron-core could not be installed: the moeflow.megatron tests will be skipped"
fi
echo "setup: Python environment $venv ($("$py" -c 'import sys; print(sys.version.split()[0])'))," \
     "torch: $("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not installed (its tests and example are skipped)')"

cuda_opt="${MOEFLOW_WITH_CUDA:-}"
if [[ "${cuda_opt,,}" =~ ^(off|0|no|false|n)$ ]]; then
  echo "setup: MOEFLOW_WITH_CUDA=${MOEFLOW_WITH_CUDA}: the CPU backend only"
elif command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA toolkit found: the CUDA backend is built (MOEFLOW_WITH_CUDA=OFF: CPU only)"
else
  echo "setup: no CUDA toolkit found (nvcc on PATH, /usr/local/cuda/bin): the CPU backend only"
fi
