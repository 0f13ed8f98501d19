#!/usr/bin/env bash
# Runs HERE (with PyPI), before bench/gpu_check.sh runs on the borrowed GPU machine (no network,
# Python 3.12, torch cu130): fills .whl/ with the wheels the check needs that the machine lacks,
# checks that what travels stays under the size limit, and prints the `run` call to make.
#
#   bash bench/gpu_prepare.sh
#
# deepspeed is built here as a pure-Python wheel (DS_BUILD_OPS=0: no op compiled; the trainer passes
# torch's AdamW, so no FusedAdam/CPUAdam is JIT-built on the GPU either). bitsandbytes ships one
# library per CUDA/ROCm version (43 MB): only the CPU and CUDA 13.x ones are kept (torch cu130 loads
# libbitsandbytes_cuda130.so).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PY=${PY:-.venv/bin/python}
LIMIT_MIB=${LIMIT_MIB:-60}
DS_VERSION=${DS_VERSION:-$("$PY" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null || echo 0.19.8)}
PINNED=(
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 bitsandbytes==0.50.2
)
TARGET=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

exclude=$(git rev-parse --git-path info/exclude)
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl
mkdir .whl

"$PIP" download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d .whl "${PINNED[@]}"
DS_BUILD_OPS=0 "$PIP" wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DS_VERSION"

ds=$(ls .whl/deepspeed-*.whl)
case $ds in *-py3-none-any.whl) ;; *) echo "gpu_prepare: $ds is not a pure-Python wheel" >&2; exit 1 ;; esac
if unzip -l "$ds" | grep -q '\.so$' || unzip -p "$ds" deepspeed/git_version_info_installed.py | grep -q "': True"; then
  echo "gpu_prepare: $ds holds compiled ops; build it with DS_BUILD_OPS=0" >&2
  exit 1
fi

bnb=$(ls .whl/bitsandbytes-*.whl)
unzip -l "$bnb" | grep -q libbitsandbytes_cuda130.so || { echo "gpu_prepare: no CUDA 13.0 library in $bnb" >&2; exit 1; }
"$PY" bench/gpu_check.py slim-wheel "$bnb" --keep libbitsandbytes_cpu.so 'libbitsandbytes_cuda13*.so'

# The wheels install together for the GPU machine's Python, and the slimmed bitsandbytes imports.
check=$(mktemp -d)
"$PIP" install -q --no-index --no-deps --no-compile --target "$check/all" --only-binary=:all: "${TARGET[@]}" .whl/*.whl
"$PIP" install -q --no-index --no-deps --no-compile --target "$check/bnb" "$bnb"
PYTHONPATH=$check/bnb "$PY" -c 'import bitsandbytes as b; print("bitsandbytes", b.__version__, "imports (CPU here)")' 2>&1 |
  grep -v WARNING | tail -n 1
rm -rf "$check"

# What travels: tracked files, untracked files git does not ignore, and the carried .whl.
tree_bytes=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true) |
  awk '{s += $1} END {print s + 0}')
wheel_bytes=$(du -cb .whl/*.whl | awk 'END {print $1}')
echo
echo "wheels in .whl/:"
for w in .whl/*.whl; do printf '  %-80s %6.2f MiB\n' "${w#.whl/}" "$(echo "$(stat -c %s "$w") / 1048576" | bc -l)"; done
total_mib=$(( (tree_bytes + wheel_bytes) / 1048576 ))
echo "working tree $((tree_bytes / 1048576)) MiB + .whl $((wheel_bytes / 1048576)) MiB = ${total_mib} MiB (limit 64, aim <= ${LIMIT_MIB})"
if [ "$total_mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu_prepare: over ${LIMIT_MIB} MiB: ignore or remove large untracked files first" >&2
  exit 1
fi
echo
echo "run it (the device tool's run; one call, about 6 minutes; the summary is at the end of output_tail):"
echo "  command: bash bench/gpu_check.sh"
echo '  carry:   [".whl"]'
echo "  timeout_s: 420"
echo "files back: \$OUT/gpu_check.json, \$OUT/gpu_check_summary.txt, \$OUT/gpu_check_logs.tar.gz"
