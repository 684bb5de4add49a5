#!/usr/bin/env bash
# graphscale's one-shot GPU check (issue 12).  On a machine with one NVIDIA
# GPU and nothing but Python: makes a virtual environment, installs what it
# needs, runs the `cuda`-marked tests (tests/stacks/test_cuda.py,
# tests/deepspeed_engines/test_fp16*.py),
# the fp16 two-engine check with the loss scales forced apart
# (scripts/fp16_check.py), `benchmarks/overhead.py --device cuda --quick`, and
# with the time left the DeepSpeed shape tests on CUDA; writes a markdown
# summary.  Meant to finish in under 8 minutes.  See docs/gpus.md.
#
#   scripts/gpu_check.sh [OUTPUT_DIR]          (default: ./gpu-check)
#
# Environment:
#   PYTHON              the Python to start from (default python3).  If its torch
#                       sees a GPU, the venv uses that torch (and whatever else
#                       that Python has) instead of downloading one.
#   GRAPHSCALE_WHEELS   a folder of wheels for an offline install: DeepSpeed and
#                       those of its requirements the Python lacks (made by
#                       scripts/gpu_wheels.sh).  Without it, pip's default index.
#   GPU_CHECK_WORK      where the venv and caches go (default ${TMPDIR:-/tmp}/graphscale-gpu-check)
#   GPU_CHECK_BUDGET_S  the whole run's time budget in seconds (default 460)
#
# Exit status: 0 every step passed; 1 a step failed (see the summary);
# 2 no usable NVIDIA GPU here (nothing run); 3 set-up failed (an install).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/graphscale-gpu-check}
BUDGET=${GPU_CHECK_BUDGET_S:-460}
PY=${PYTHON:-python3}
SUMMARY=$OUT/gpu_check.md
ENVLOG=$OUT/env.txt
SECONDS=0
: >"$ENVLOG"

say() { echo "gpu_check: $*" >&2; }
left() { echo $((BUDGET - SECONDS)); }

# Early exits write the summary too, so whoever reads OUTPUT_DIR sees why.
give_up() {  # status, one-line reason
    say "$2"
    {
        echo "# graphscale GPU check"
        echo
        echo "**Not run: $2** (exit status $1, after ${SECONDS} s)."
        echo
    } >"$SUMMARY"
    exit "$1"
}

# ------------------------------------------------------------------ is there a GPU?
if ! command -v nvidia-smi >/dev/null 2>&1; then
    give_up 2 "no NVIDIA GPU here: nvidia-smi is not installed (no NVIDIA driver). This check needs one NVIDIA GPU; run the CPU test suite instead (pytest)."
fi
if ! nvidia-smi -L >>"$ENVLOG" 2>&1 || ! grep -q '^GPU ' "$ENVLOG"; then
    give_up 2 "no NVIDIA GPU here: nvidia-smi lists none ($(head -n 1 "$ENVLOG")). This check needs one NVIDIA GPU."
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    give_up 3 "no Python: '$PY' not found (set PYTHON=/path/to/python3)"
fi

# ------------------------------------------------------------------ the environment
mkdir -p "$WORK"
VENV=$WORK/venv
rm -rf "$VENV"
# A torch built for CUDA is used as it is (if it sees no GPU, a new one would not either:
# the driver is the problem); a CPU build, or none, is replaced by pip's default (CUDA) build.
torch_state=$("$PY" -c 'import torch; print("gpu" if torch.cuda.is_available() else "cuda-build" if torch.version.cuda else "cpu-build")' 2>>"$ENVLOG" | tail -n 1)
echo "torch in $PY: ${torch_state:-none}" >>"$ENVLOG"
case "$torch_state" in
    gpu|cuda-build) torch_from="$PY" ;;
    *) torch_from=index ;;
esac
say "creating $VENV (torch from: $torch_from)"
if ! "$PY" -m venv "$VENV" >>"$ENVLOG" 2>&1; then
    rm -rf "$VENV"
    "$PY" -m venv --without-pip "$VENV" >>"$ENVLOG" 2>&1 || give_up 3 "could not create a venv with $PY -m venv (see env.txt)"
fi
VPY=$VENV/bin/python
if [ "$torch_from" != index ]; then
    # The venv sees the starting Python's packages (torch, and pip if the venv has none), after its own.
    site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -c 'import os, site, sys, sysconfig
std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
paths = [*site.getsitepackages(), *(p for p in sys.path if p and os.path.isdir(p))]  # .pth-added folders too
print("\n".join(p for p in dict.fromkeys(paths) if os.path.realpath(p) not in std
                and not os.path.realpath(p).startswith(tuple(s + os.sep + "lib-dynload" for s in std))))' \
        >"$site/_graphscale_gpu_check_parent.pth"
fi
"$VPY" -m pip --version >>"$ENVLOG" 2>&1 || give_up 3 "no pip in the venv, and none in $PY to borrow"

PIP=("$VPY" -m pip install -q --disable-pip-version-check --no-warn-script-location)
if [ -n "${GRAPHSCALE_WHEELS:-}" ]; then
    [ -d "$GRAPHSCALE_WHEELS" ] || give_up 3 "GRAPHSCALE_WHEELS=$GRAPHSCALE_WHEELS is not a folder"
    PIP+=(--no-index --find-links "$GRAPHSCALE_WHEELS")
fi
if [ "$torch_from" = index ]; then
    say "installing torch from the default index (a CUDA build)"
    "${PIP[@]}" torch >>"$ENVLOG" 2>&1 || give_up 3 "could not install torch (offline? give a Python whose torch sees the GPU: PYTHON=...)"
fi
if ! "$VPY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >>"$ENVLOG" 2>&1; then
    give_up 2 "no usable GPU: nvidia-smi lists one but torch.cuda.is_available() is False in the venv ($("$VPY" -c 'import torch; print("torch", torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -n 1))"
fi
if ! "$VPY" -c 'import deepspeed' >>"$ENVLOG" 2>&1; then
    # DeepSpeed without its requirements first, then only those missing: pip then never re-resolves
    # (or tries to replace) the torch it found.
    if [ -n "${GRAPHSCALE_WHEELS:-}" ]; then
        ds=("$GRAPHSCALE_WHEELS"/deepspeed-*.whl)
        [ -e "${ds[0]}" ] || give_up 3 "no deepspeed-*.whl in GRAPHSCALE_WHEELS=$GRAPHSCALE_WHEELS (scripts/gpu_wheels.sh makes one)"
        ds=("${ds[0]}")
    else
        ds=("deepspeed==${DEEPSPEED_VERSION:-0.19.8}")
    fi
    say "installing ${ds[0]##*/}"
    "${PIP[@]}" --no-deps "${ds[0]}" >>"$ENVLOG" 2>&1 || give_up 3 "could not install ${ds[0]##*/} (offline? set GRAPHSCALE_WHEELS; see env.txt)"
    ds_missing=$("$VPY" - <<'EOF'
import importlib.metadata as md, re
missing = []
for req in md.requires("deepspeed") or []:
    if ";" in req:  # extras only
        continue
    name = re.split(r"[<>=!~ \[]", req, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
print(" ".join(missing))
EOF
)
    if [ -n "$ds_missing" ]; then
        say "installing DeepSpeed's missing requirements: $ds_missing"
        "${PIP[@]}" $ds_missing >>"$ENVLOG" 2>&1 || give_up 3 "could not install DeepSpeed's requirements $ds_missing (see env.txt)"
    fi
    "$VPY" -c 'import deepspeed' >>"$ENVLOG" 2>&1 || give_up 3 "deepspeed does not import after the install (see env.txt)"
fi
missing=$("$VPY" - <<'EOF'
import importlib.util
need = {"pytest": "pytest>=7", "hypothesis": "hypothesis>=6", "tabulate": "tabulate", "tqdm": "tqdm",
        "transformers": "transformers>=5.23", "matplotlib": "matplotlib"}
print(" ".join(spec for mod, spec in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    say "installing $missing"
    "${PIP[@]}" $missing >>"$ENVLOG" 2>&1 || give_up 3 "could not install the test extras: $missing"
fi

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export GRAPHSCALE_CACHE=$WORK/graphscale-cache TORCH_EXTENSIONS_DIR=$WORK/torch-extensions
cd "$REPO"
"$VPY" - >>"$ENVLOG" 2>&1 <<'EOF'
import platform, torch, deepspeed, graphscale
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "deepspeed", deepspeed.__version__, "graphscale", graphscale.__file__)
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
EOF
# The native walker's build, in the background while the tests run on the Python walker (identical plans).
(nice "$VPY" -m graphscale build >"$WORK/native-build.log" 2>&1 &)
say "set-up done in ${SECONDS} s"

# ------------------------------------------------------------------ the steps
declare -a ROWS=()
status=0

pytest_counts() {  # log -> "N passed, M failed, ..." (the final line, else counted from -v lines)
    local last
    last=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected).* in [0-9.]+s' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
    if [ -n "$last" ]; then echo "$last"; return; fi
    echo "cut short: $(grep -cE ' PASSED' "$1") passed, $(grep -cE ' (FAILED|ERROR)' "$1") failed, $(grep -cE ' SKIPPED' "$1") skipped so far"
}

run_step() {  # name, seconds, log, command...
    local name=$1 limit=$2 log=$3 t0=$SECONDS rc
    shift 3
    if [ "$limit" -lt 20 ]; then
        ROWS+=("| $name | not run: no time left | - |")
        return
    fi
    say "$name (up to $limit s)"
    timeout -k 10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local verdict=passed
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="timed out after $limit s"; status=1
    elif [ $rc -ne 0 ]; then verdict="FAILED (exit $rc)"; status=1; fi
    local detail=""
    case "${log##*/}" in pytest_*|shapes_*) detail=$(pytest_counts "$log") ;; esac
    ROWS+=("| $name | $verdict${detail:+: $detail} | $((SECONDS - t0)) s |")
}

PYTEST=("$VPY" -m pytest -v -p no:randomly -o addopts="-p no:cacheprovider" -W ignore::DeprecationWarning)
# Tests build fresh engines, one rank each: with pytest-xdist, several processes share the GPU
# (each its own one-rank process group on a free port).
if "$VPY" -c 'import xdist' >/dev/null 2>&1; then
    PYTEST+=(-n "${GPU_CHECK_WORKERS:-6}")
    unset MASTER_PORT
fi

upto() { local t=$(($(left) - $2)); echo $((t < $1 ? t : $1)); }  # max seconds, seconds to keep for later steps

# tests/stacks/test_cuda.py holds the DeepSpeed shapes on CUDA (exact and DeepSpeed alone), the device-thread
# scenarios; tests/deepspeed_engines/test_fp16*.py the fp16 tests' cuda variants (fp16 without any patch).
run_step "cuda-marked tests (tests/stacks/test_cuda.py, tests/deepspeed_engines/test_fp16*.py)" "$(upto 200 220)" \
    "$OUT/pytest_cuda.log" env GRAPHSCALE_WALKER=python "${PYTEST[@]}" -m cuda tests/stacks/test_cuda.py \
    tests/deepspeed_engines/test_fp16.py tests/deepspeed_engines/test_fp16_training.py
run_step "fp16 two-engine run, loss scales 256 and 16 (scripts/fp16_check.py)" "$(upto 60 160)" \
    "$WORK/fp16.log" env GRAPHSCALE_WALKER=python "$VPY" scripts/fp16_check.py --out "$OUT/fp16.md"
run_step "benchmarks/overhead.py --device cuda --quick" "$(upto 240 10)" \
    "$OUT/overhead_cuda.txt" "$VPY" benchmarks/overhead.py --device cuda --quick \
    --json "$OUT/overhead_cuda.json" --plot "$OUT/overhead_cuda.png"
# With the time left: the whole shape matrix of tests/deepspeed_engines/test_shapes.py on CUDA.
run_step "DeepSpeed shape tests on CUDA, full matrix (tests/deepspeed_engines/test_shapes.py, graphscale + DeepSpeed alone)" \
    "$(upto 600 10)" "$OUT/shapes_cuda.log" env GRAPHSCALE_WALKER=python "${PYTEST[@]}" tests/deepspeed_engines/test_shapes.py \
    -k "test_every_engine_gets_its_own_factor_under_graphscale or test_deepspeed_alone_is_wrong_exactly_where_documented"

# ------------------------------------------------------------------ the summary
{
    echo "# graphscale GPU check"
    echo
    echo '```text'
    grep -E '^(GPU |python |gpu )' "$ENVLOG"
    echo "torch from: $torch_from; wheels: ${GRAPHSCALE_WHEELS:-the default package index}; native walker build: $(tail -n 1 "$WORK/native-build.log" 2>/dev/null)"
    echo '```'
    echo
    echo "| step | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "Total ${SECONDS} s (budget ${BUDGET} s). Logs beside this file."
    for log in "$OUT/pytest_cuda.log" "$OUT/shapes_cuda.log"; do
        if [ -f "$log" ] && grep -qE ' (FAILED|ERROR)' "$log"; then
            echo
            echo "Failed in ${log##*/}:"
            echo '```text'
            grep -E ' (FAILED|ERROR)' "$log" | head -n 25
            echo '```'
        fi
    done
    if [ -f "$WORK/fp16.log" ] && ! [ -s "$OUT/fp16.md" ]; then
        echo
        echo "fp16 check output (tail):"
        echo '```text'
        tail -n 15 "$WORK/fp16.log"
        echo '```'
    fi
    if [ -s "$OUT/fp16.md" ]; then
        echo
        echo "## fp16: two engines, loss scales forced apart"
        echo
        cat "$OUT/fp16.md"
    fi
    if [ -f "$OUT/overhead_cuda.txt" ]; then
        echo
        echo "## benchmarks/overhead.py --device cuda --quick"
        echo
        echo '```text'
        sed -n '/^graphscale overhead:/,$p' "$OUT/overhead_cuda.txt"
        echo '```'
    fi
} >"$SUMMARY"
say "summary: $SUMMARY (exit $status)"
exit $status
