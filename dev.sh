#!/usr/bin/env bash
# The two entry points named in the README:
#   ./dev.sh demo   install the package and scikit-learn into .venv (nothing else) and run the
#                   digits demo (local Spark, local store)
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

# installed VENV RECIPE FILES...: whether RECIPE was installed into VENV from these FILES
installed() {
  local venv=$1 recipe=$2
  shift 2
  [[ -f $venv/.installed-$recipe && $(cat "$venv/.installed-$recipe") == "$(cat "$@" | sha256sum | cut -c1-16)" ]]
}

# install VENV RECIPE FILES...: run RECIPE into VENV unless it was installed from these FILES
install() {
  local venv=$1 recipe=$2
  shift 2
  installed "$venv" "$recipe" "$@" && return
  if [[ ! -x $venv/bin/python ]]; then
    "$PYTHON" -m venv "$venv"
  fi
  "$venv/bin/pip" install --quiet --upgrade pip
  "$recipe" "$venv/bin/pip"
  cat "$@" | sha256sum | cut -c1-16 > "$venv/.installed-$recipe"
}

# the demo needs the package and scikit-learn only; the test stack holds all of that too
demo_stack() {
  "$1" install --quiet -r requirements-dev.txt -e ".[examples]"
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
  .venv/bin/python -m tests.jvm_archive  # once a venv: the test JVMs' class-data archive
  .venv/bin/python -m pytest "$@"
}

test_legacy() {
  install .venv-legacy legacy_stack setup.py requirements-legacy.txt
  .venv-legacy/bin/python -m tests.jvm_archive
  .venv-legacy/bin/python -m pytest -m legacy "$@"
}

case "${1:-}" in
  demo)
    installed .venv default_stack setup.py requirements-dev.txt ||
      install .venv demo_stack setup.py requirements-dev.txt
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
