#!/usr/bin/env bash
# Builds the offline wheelhouse the trainer_env role copies to every node:
#   the CPU torch wheel from this machine's disk (never the index: that is a multi-GB CUDA build),
#   this project as a wheel (rebuilt whenever trainer/ or pyproject.toml changed),
#   and everything `clustertrain[train]` needs, as cp311 manylinux x86_64 wheels (Debian bookworm).
# Nodes then install with:
#   pip install --no-index --find-links DIR torch==2.13.0
#   pip install --no-index --find-links DIR 'clustertrain[train]'
# Usage: scripts/testbed/wheelhouse.sh [DIR]   (default: .cache/wheelhouse in the repo)
# Quiet and quick when nothing changed.
set -euo pipefail
source "$(dirname "$0")/lib.sh"

dir="${1:-$repo_root/.cache/wheelhouse}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pip=("${PIP:-$repo_root/.venv/bin/pip}" --disable-pip-version-check -q)
torch_wheel="${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*manylinux*x86_64.whl 2>/dev/null | head -n 1)}"
[ -f "$torch_wheel" ] || die "no CPU torch 2.13.0 wheel for cp311 in /opt/wheels; set TORCH_WHEEL=PATH"

# 1. This project: a new wheel whenever its sources changed (the version number does not move).
project_hash="$(cd "$repo_root" && find pyproject.toml trainer -type f ! -path '*/__pycache__/*' \
  ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)"
if [ "$(cat "$dir/.project.hash" 2>/dev/null)" != "$project_hash" ]; then
  log "building the clustertrain wheel"
  rm -f "$dir"/clustertrain-*.whl
  build="$(mktemp -d)"
  # Build from a copy: an in-tree build leaves build/ and egg-info behind in the work tree.
  (cd "$repo_root" && tar -c --exclude=__pycache__ pyproject.toml trainer $(ls README.md LICENSE* 2>/dev/null)) \
    | tar -C "$build" -x
  "${pip[@]}" wheel --no-deps --no-build-isolation -w "$dir" "$build" >/dev/null
  rm -rf "$build"
  echo "$project_hash" >"$dir/.project.hash"
fi
project_wheel="$(ls "$dir"/clustertrain-*.whl)"

# 2. The training stack: only when the dependency lists (pyproject.toml, this script) changed.
deps_hash="$(cat "$repo_root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
deps_hash="$deps_hash-$(basename "$torch_wheel")"
if [ "$(cat "$dir/.deps.hash" 2>/dev/null)" != "$deps_hash" ]; then
  log "collecting the training stack's wheels into $dir (a minute the first time)"
  cp -u "$torch_wheel" "$dir/"
  # The torch wheel is named on the command line, so its own pin satisfies `torch>=...` in the
  # train extra and pip never looks for torch on the index. pip wheel downloads binary wheels
  # and builds the sdist-only ones (deepspeed is pure Python) into wheels.
  "${pip[@]}" wheel -w "$dir" --find-links "$dir" \
    "$dir/$(basename "$torch_wheel")" "$project_wheel[train]" \
    deepspeed accelerate numpy nvidia-ml-py pyyaml rich \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$deps_hash" >"$dir/.deps.hash"
fi
