#!/bin/sh
# Create the virtual environment $1 if missing and install what `make demo` needs into it
# (scripts/demo_requirements.py), quietly. $PYTHON: the interpreter (default python3.11).
#
# Fast on a fresh clone: no wheel of the project is built (the demo runs from the source
# tree), nothing is byte-compiled at install (scipy's ~1,000 modules: half the install time;
# the few the demo imports compile on first use), and the venv gets no pip of its own when the
# host's can install into it (pip >= 22.3, --python): ensurepip's copy costs ~7 s. The
# development install adds pip to such a venv (Makefile).
set -eu
venv=$1
python=${PYTHON:-python3.11}
here=$(dirname "$0")
test -x "$venv/bin/python" || "$python" -m venv --without-pip "$venv"
if "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    set -- "$venv/bin/python" -m pip
elif "$python" -m pip --python "$venv/bin/python" --version >/dev/null 2>&1; then
    set -- "$python" -m pip --python "$venv/bin/python"
else
    "$venv/bin/python" -m ensurepip --default-pip >/dev/null
    set -- "$venv/bin/python" -m pip
fi
# shellcheck disable=SC2046 # one requirement per line, none with spaces
"$@" install --quiet --disable-pip-version-check --no-compile $("$python" "$here/demo_requirements.py")
