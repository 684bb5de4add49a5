#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine that has no network but a
# Python with a CUDA torch (and numpy, ninja, psutil, py-cpuinfo, msgpack,
# einops, tqdm, packaging, as such images have): DeepSpeed, built here as a
# pure-Python wheel (its ops compile on first use, on the GPU machine), and
# those of its requirements such images lack (hjson, pydantic and pydantic's
# own).  Run on any machine with pip and a package index, then copy the
# folder along and point GRAPHSCALE_WHEELS at it.
#
#   scripts/gpu_wheels.sh [FOLDER] [PYTHON_VERSION]    (default: .whl 3.12)
#
# PYTHON_VERSION is the GPU machine's (pydantic-core is compiled per version).
set -euo pipefail

DIR=${1:-.whl}
PYVER=${2:-3.12}
DEEPSPEED_VERSION=${DEEPSPEED_VERSION:-0.19.8}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
"$PY" -m pip wheel -q --no-deps "deepspeed==$DEEPSPEED_VERSION" -w "$DIR"
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" hjson "pydantic>=2"
ls -l "$DIR"
