#!/usr/bin/env bash
# Builds an offline wheelhouse of the nodes' training stack: torch (the CPU or the CUDA build),
# everything in the project's `train` extra and uv (the installer of the nodes' build), for the
# nodes' Python version and platform. The
# trainer_env role copies it to the node that builds (training_wheelhouse) and installs with --no-index, so
# nodes without internet get the same wheels everywhere. The project itself is not in it: the role
# builds this checkout's wheel on the controller (scripts/build-node-wheel.py) and copies that.
#
#   scripts/wheelhouse.sh [options] [DIR]              (default DIR: .cache/wheelhouse in the repo)
#     --variant cpu|cuda       which torch build (default cpu)
#     --torch-version V        default 2.13.0
#     --torch-index-url URL    the index that serves that build (your torch mirror; default: pip's)
#     --torch-wheel FILE       use this torch wheel file instead of an index
#     --python-version X.Y     the nodes' Python (default: this Python's)
#     --platform TAG           the nodes' platform tag (default manylinux_2_28_x86_64 when the
#                              Python version differs from this one's, else this machine's)
# With no torch options on a machine that has the CPU build of torch 2.13.0 for cp311 on disk
# (/opt/wheels), that file is used (the test bed). Quiet and quick when nothing changed.
set -euo pipefail
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
log() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 2; }

variant=cpu torch_version=2.13.0 torch_index="" torch_wheel="${TORCH_WHEEL:-}" py_version="" platform=""
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant="${2:?}"; shift 2 ;;
    --torch-version) torch_version="${2:?}"; shift 2 ;;
    --torch-index-url) torch_index="${2:?}"; shift 2 ;;
    --torch-wheel) torch_wheel="${2:?}"; shift 2 ;;
    --python-version) py_version="${2:?}"; shift 2 ;;
    --platform) platform="${2:?}"; shift 2 ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) dir="$1"; shift ;;
  esac
done
case "$variant" in cpu | cuda) ;; *) die "--variant must be cpu or cuda (got '$variant')" ;; esac
[[ "$torch_version" =~ ^[0-9]+(\.[0-9]+)*$ ]] || die "--torch-version must look like 2.13.0 (got '$torch_version')"

python="${PYTHON:-$repo_root/.venv/bin/python}"
here_version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
py_version="${py_version:-$here_version}"
[[ "$py_version" =~ ^3\.[0-9]+$ ]] || die "--python-version must look like 3.10 (got '$py_version')"
cross=0
if [ "$py_version" != "$here_version" ] || [ -n "$platform" ]; then
  cross=1
  platform="${platform:-manylinux_2_28_x86_64}"
fi

if [ -z "$torch_wheel" ] && [ -z "$torch_index" ] && [ "$variant" = cpu ] && [ "$py_version" = 3.11 ]; then
  torch_wheel="$(ls /opt/wheels/torch-"$torch_version"+cpu-cp311-*manylinux*x86_64.whl 2>/dev/null | head -n 1 || true)"
fi
if [ -z "$torch_wheel" ] && [ -z "$torch_index" ] && [ "$variant" = cpu ]; then
  die "no CPU torch wheel: pass --torch-index-url (your index of torch's CPU builds) or --torch-wheel FILE"
fi

dir="${dir:-$repo_root/.cache/wheelhouse}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pip=("$python" -m pip --disable-pip-version-check -q)

# The nodes' requirement list is the project wheel's `train` extra.
node_build="$("$python" "$repo_root/scripts/build-node-wheel.py" --out "${XDG_CACHE_HOME:-$HOME/.cache}/clustertrain")"
requirements="$("$python" -c 'import json, sys; print(json.loads(sys.argv[1])["requirements"])' "$node_build")"

recipe="$(cat "$requirements" "$0" | sha256sum | cut -c1-16)-$variant-$torch_version-$py_version-$platform"
recipe="$recipe-$(basename "${torch_wheel:-$torch_index}" | tr -c 'A-Za-z0-9._+-' _)"
if [ "$(cat "$dir/.recipe" 2>/dev/null)" = "$recipe" ]; then
  exit 0
fi
log "collecting torch ($variant) and the training stack for Python $py_version into $dir (minutes the first time)"
rm -f "$dir/.recipe"

torch_args=()
if [ -n "$torch_wheel" ]; then
  [ -f "$torch_wheel" ] || die "no such torch wheel: $torch_wheel"
  cp -u "$torch_wheel" "$dir/"
  torch_args=("$dir/$(basename "$torch_wheel")")
else
  torch_args=("torch==$torch_version")
  [ -z "$torch_index" ] || torch_args+=(--extra-index-url "$torch_index")
fi

quiet_links() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
if [ "$cross" = 0 ]; then
  # Same Python as the nodes: pip wheel downloads binary wheels and builds the sdist-only ones
  # (deepspeed is pure Python). The torch wheel is named on the command line, so its own pin
  # satisfies `torch>=...` in the list and pip never looks for torch elsewhere.
  "${pip[@]}" wheel -w "$dir" --find-links "$dir" "${torch_args[@]}" -r "$requirements" uv 2> >(quiet_links)
else
  # Another Python or platform: binary wheels for the nodes' tags; sdist-only pure-Python packages
  # are built here first (their wheels are py3-none-any).
  grep -E '^deepspeed' "$requirements" | xargs -r "${pip[@]}" wheel --no-deps -w "$dir" 2> >(quiet_links)
  "${pip[@]}" download -d "$dir" --find-links "$dir" --only-binary=:all: --implementation cp \
    --python-version "$py_version" --platform "$platform" "${torch_args[@]}" -r "$requirements" uv 2> >(quiet_links)
fi
cp "$requirements" "$dir/node-requirements.txt"
echo "$recipe" >"$dir/.recipe"
