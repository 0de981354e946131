#!/usr/bin/env bash
# The test suite under what differs between machines, one variation after another (not part of the default
# `python -m pytest -q`):
#
#   bash tests/variations.sh                     # all of them (4-6 min each on 2 cores, 26 min in all)
#   bash tests/variations.sh random threads1     # some of them, by name
#   bash tests/variations.sh random -- tests/test_kl.py   # pytest arguments after --
#
#   threads1   OMP_NUM_THREADS=1
#   threads2   OMP_NUM_THREADS=2
#   avx2       ATEN_CPU_CAPABILITY=avx2    (torch's AVX2 kernels; the default path where AVX-512 is missing)
#   scalar     ATEN_CPU_CAPABILITY=default (torch's non-vectorised kernels: other float orders)
#   random     the tests in random order (pytest-randomly, installed for this script only, into
#              $VARIATIONS_DIR/site); the order's seed is printed, RANDOM_SEED=<seed> repeats that order
#
# Each variation prints pytest's summary line; the script exits non-zero if any variation failed.
set -u
cd "$(dirname "$0")/.."
ALL=(threads1 threads2 avx2 scalar random)
names=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the --
[ ${#names[@]} -eq 0 ] && names=("${ALL[@]}")
VARIATIONS_DIR=${VARIATIONS_DIR:-/tmp/rlhf-variations}
mkdir -p "$VARIATIONS_DIR"
RANDOMLY=pytest-randomly==5.1.0

failed=()
for name in "${names[@]}"; do
  env_vars=(OMP_WAIT_POLICY=PASSIVE)
  plugin=(-p no:randomly)  # the default order, even where pytest-randomly is installed
  case "$name" in
    threads1) env_vars+=(OMP_NUM_THREADS=1) ;;
    threads2) env_vars+=(OMP_NUM_THREADS=2) ;;
    avx2) env_vars+=(ATEN_CPU_CAPABILITY=avx2) ;;
    scalar) env_vars+=(ATEN_CPU_CAPABILITY=default) ;;
    random)
      if [ ! -d "$VARIATIONS_DIR/site/pytest_randomly" ]; then
        python -m pip install --quiet --no-deps --target "$VARIATIONS_DIR/site" "$RANDOMLY" || exit 2
      fi
      env_vars+=(PYTHONPATH="$VARIATIONS_DIR/site${PYTHONPATH:+:$PYTHONPATH}")
      plugin=(--randomly-seed="${RANDOM_SEED:-$RANDOM$RANDOM}") ;;
    *) echo "unknown variation '$name'; the variations: ${ALL[*]}" >&2; exit 2 ;;
  esac
  echo "== $name: ${env_vars[*]} python -m pytest -q ${plugin[*]} $*"
  start=$(date +%s)
  env "${env_vars[@]}" nice -n 10 python -m pytest -q -p no:cacheprovider "${plugin[@]}" "$@" \
      > "$VARIATIONS_DIR/$name.log" 2>&1
  code=$?
  echo "   $(tail -n 1 "$VARIATIONS_DIR/$name.log") [$(( $(date +%s) - start )) s, log $VARIATIONS_DIR/$name.log]"
  [ $code -eq 0 ] || failed+=("$name")
done
[ ${#failed[@]} -eq 0 ] && echo "all passed: ${names[*]}" || { echo "failed: ${failed[*]}"; exit 1; }
