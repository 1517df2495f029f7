#!/usr/bin/env bash
# The two entry points named in the README:
#   ./dev.sh demo   install into .venv and run the digits demo (local Spark, local store)
#   ./dev.sh test   install and run the whole test suite: all tests on the default stack
#                   (.venv), then the tests marked `legacy` on the petastorm stack
#                   (.venv-legacy: pyspark 3.5, pyarrow 14, see requirements-legacy.txt)
# Without arguments the tests run in two pytest-xdist workers, each test file in one worker:
# much of the suite's time is spent starting JVMs and Python processes, which overlap well.
# With arguments, `./dev.sh test ARGS` runs pytest ARGS (in one process unless ARGS say
# `-n N`) on the default stack only, and `./dev.sh test-legacy ARGS` on the legacy stack only.
# Needs only Python 3.10+ and Java 17 on the machine.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
WORKERS=(-n 2 --dist loadfile)  # the whole suite's pytest-xdist workers (see above)

# install VENV RECIPE FILES...: (re)create VENV when the hash of FILES changed
install() {
  local venv=$1 recipe=$2
  shift 2
  if [[ ! -x $venv/bin/python ]]; then
    "$PYTHON" -m venv "$venv"
  fi
  local stamp=$venv/.installed want
  want=$(cat "$@" | sha256sum | cut -c1-16)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    "$venv/bin/pip" install --quiet --upgrade pip
    "$recipe" "$venv/bin/pip"
    echo "$want" > "$stamp"
  fi
}

default_stack() {
  "$1" install --quiet -r requirements-dev.txt -e ".[test]"
}

# petastorm 0.13.1 pins setuptools<70 while torch 2.13 declares setuptools>=77 (needed only
# to build C++ extensions), so torch and the project go in without dependency resolution.
legacy_stack() {
  "$1" install --quiet -r requirements-legacy.txt
  "$1" install --quiet --no-deps torch==2.13.0
  "$1" install --quiet --no-deps -e .
}

test_default() {
  install .venv default_stack setup.py requirements-dev.txt
  .venv/bin/ruff check spark_estimator tests examples
  .venv/bin/python -m pytest "$@"
}

test_legacy() {
  install .venv-legacy legacy_stack setup.py requirements-legacy.txt
  .venv-legacy/bin/python -m pytest -m legacy "$@"
}

case "${1:-}" in
  demo)
    install .venv default_stack setup.py requirements-dev.txt
    shift
    exec .venv/bin/python examples/digits_classifier.py "$@"
    ;;
  test)
    shift
    if [[ $# -gt 0 ]]; then
      test_default "$@"
    else
      test_default "${WORKERS[@]}"
      test_legacy "${WORKERS[@]}"
    fi
    ;;
  test-legacy)
    shift
    test_legacy "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | ./dev.sh test [pytest args] | ./dev.sh test-legacy [pytest args]" >&2
    exit 2
    ;;
esac
