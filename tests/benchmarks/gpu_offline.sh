#!/usr/bin/env bash
# The GPU suite on a CUDA machine without a package index, in a short lease.
#
#   bash tests/benchmarks/gpu_offline.sh prepare [DIR]   # here, with pip: wheels into DIR
#   bash tests/benchmarks/gpu_offline.sh run [DIR] [OUT] # there: install them, run the suite
#
# prepare: gradlog's wheel and its dependencies that CUDA images usually lack (zarr,
# numcodecs, donfig, crc32c, google-crc32c; torch, numpy, pyarrow, typer, rich and tqdm are
# expected there) for CPython $PYVER (default 3.12) on manylinux x86-64, at the versions
# installed here. DIR defaults to .whl (keep it out of git: .git/info/exclude).
# run: installs DIR's wheels into /tmp/site (PYTHONPATH), then runs, each part under its
# own time limit so that one hang cannot take the lease, in the order that says most first:
# the gpu tests; the compact forms' compute table with batch_grad="sum" and its floor; the
# writer and the chunked head; where the time goes (with the device's idle time); which
# stages the device waits on (gpu_idle.py); the ~1B Llama at 8K tokens a step (compact
# forms); the autograd rows. $BUDGET seconds in all (default 540). Tables go to OUT (default gpu_out),
# one file per part (leases may bring back only a few files), logs to /tmp.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-}
dir=${2:-.whl}

if [ "$mode" = prepare ]; then
  pyver=${PYVER:-3.12}
  mkdir -p "$dir"
  rm -f "$dir"/gradlog-*.whl
  python3 -m pip wheel -q --no-deps --no-build-isolation . -w "$dir" || exit 1
  pins=()
  for name in zarr numcodecs donfig crc32c google-crc32c; do
    version=$(python3 -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$version" ] || { echo "$name is not installed here: pip install -e . first"; exit 1; }
    pins+=("$name==$version")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}" || exit 1
  ls "$dir"
  exit 0
fi
if [ "$mode" != run ]; then
  echo "usage: $0 prepare [DIR] | run [DIR] [OUT]"; exit 2
fi

out=$(realpath -m "${3:-gpu_out}")
mkdir -p "$out" /tmp/gpu_offline
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$dir"/*.whl > /tmp/gpu_offline/install.txt 2>&1 \
  || { cat /tmp/gpu_offline/install.txt; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
start=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - start) )); }

part() {  # name, seconds, suite arguments...
  local name=$1 secs=$2; shift 2
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  if [ "$secs" -lt 20 ]; then echo "[$name skipped: ${l} s left]"; return; fi
  echo "=== $name (limit ${secs} s)"
  timeout -k 5 "$secs" python3 tests/benchmarks/gpu_suite.py --workdir /tmp/gpu_offline \
    "$@" --out "$out/$name.md" > "/tmp/gpu_offline/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc after $(( $(date +%s) - start )) s"
  if [ $rc -ne 0 ] || grep -q ERROR "$out/$name.md"; then tail -40 "/tmp/gpu_offline/$name.log"; fi
}

# the tests run outside the suite so that the time limit reaches pytest itself, and from
# elsewhere so that the installed gradlog is imported, not this source folder
echo "=== tests"
repo=$(pwd)
(cd /tmp/gpu_offline && timeout -k 5 150 python3 -m pytest -m gpu -q -rfEsxX --tb=short \
  -p no:cacheprovider "$repo/tests/test_gpu.py" "$repo/tests/test_store_writer.py" \
  > "$out/pytest.txt" 2>&1)
echo "=== tests rc=$? after $(( $(date +%s) - start )) s"; tail -3 "$out/pytest.txt"
part forms_sum 150 --sections floor,forms --forms norm,projection,full --batch-grads sum --reps 3
part writer_head 90 --sections writer,head --reps 3
part profile 100 --sections profile --profile-forms norm --profile-steps 2
# which host work the device waits on, by gradlog stage (gpu_idle.py), and sum against autograd
# interleaved; a script of its own, under the same time limit
l=$(left); secs=$(( l < 110 ? l : 110 ))
if [ "$secs" -ge 20 ]; then
  echo "=== idle (limit ${secs} s)"
  timeout -k 5 "$secs" python3 tests/benchmarks/gpu_idle.py --workdir /tmp/gpu_offline \
    --modes sum --reps 5 --out "$out/idle.md" > /tmp/gpu_offline/idle.log 2>&1
  echo "=== idle rc=$? after $(( $(date +%s) - start )) s"
fi
# the ~1B Llama at 8K tokens a step: its plain step no longer waits on the host
part forms_long 100 --sections forms --shapes llama-8k --forms norm,projection --batch-grads sum \
  --reps 2
part forms_autograd 120 --sections forms --forms norm,projection --batch-grads autograd --reps 3
echo "done after $(( $(date +%s) - start )) s; tables in $out"
