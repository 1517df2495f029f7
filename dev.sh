#!/usr/bin/env bash
# The two entry points named in the README:
#   ./dev.sh demo   install into .venv and run the digits demo (local Spark, local store)
#   ./dev.sh test   install into .venv and run the test suite
# Needs only Python 3.10+ and Java 17 on the machine.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
VENV=.venv

install() {
  if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -m venv "$VENV"
  fi
  # Reinstall only when the declared dependencies change.
  local stamp=$VENV/.installed
  local want
  want=$(cat setup.py requirements-dev.txt | sha256sum | cut -c1-16)
  if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet -r requirements-dev.txt -e ".[test]"
    echo "$want" > "$stamp"
  fi
}

case "${1:-}" in
  demo)
    install
    shift
    exec "$VENV/bin/python" examples/digits_classifier.py "$@"
    ;;
  test)
    install
    shift
    "$VENV/bin/ruff" check spark_estimator tests examples
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | ./dev.sh test [pytest args]" >&2
    exit 2
    ;;
esac
