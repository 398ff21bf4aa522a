#!/usr/bin/env bash
# The installed package works (issue 14): build the sdist and, from it, the wheel; install
# the wheel into a fresh virtualenv WITHOUT the dev extras; then scripts/wheel_smoke/driver.py
# makes a new `django-admin startproject` outside the checkout and drives durable there
# (migrate, worker, timers, a workflow, every admin page, durable_status).
#
#   scripts/wheel_smoke.sh                      # the virtualenv uses python3
#   PYTHON=python3.12 scripts/wheel_smoke.sh    # e.g. Python 3.12, which gets Django 6
#   DURABLE_SMOKE_LOAD=0 scripts/wheel_smoke.sh # skips the load step (100 workflow runs +
#                                               # 300 external timers at once)
#
# Building uses BUILD_PYTHON (default .venv/bin/python, from `make venv`), which has the
# dev extras' `build` and `setuptools`. Installing the wheel's dependencies needs the
# package index. Temporary files are removed on exit; exit status 0 means every check passed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILD_PYTHON="${BUILD_PYTHON:-$ROOT/.venv/bin/python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/durable-wheel-smoke.XXXXXX")"
# DURABLE_SMOKE_KEEP=1 keeps the directory (project, logs) to look at after a failure.
if [ "${DURABLE_SMOKE_KEEP:-0}" = 1 ]; then
  trap 'echo "kept $WORK"' EXIT
else
  trap 'rm -rf "$WORK"' EXIT
fi
start=$SECONDS

# Build from a copy of the package and the top-level files: setuptools would otherwise
# reuse the checkout's build/ and *.egg-info, which can hold files the configuration
# no longer ships (tests/unit/test_packaging.py does the same).
mkdir "$WORK/src"
find "$ROOT" -maxdepth 1 -type f ! -name '.*' ! -name '*.sqlite3*' -exec cp {} "$WORK/src/" \;
cp -r "$ROOT/durable" "$WORK/src/durable"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$BUILD_PYTHON" -m build --no-isolation --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 \
  || { cat "$WORK/build.log"; exit 1; }
wheel="$(ls "$WORK"/dist/*.whl)"
echo "ok    built $(basename "$wheel") and $(basename "$(ls "$WORK"/dist/*.tar.gz)")" \
  "($(unzip -l "$wheel" | grep -c 'durable/templates/') templates in the wheel)"

"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel" \
  >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
echo "ok    fresh virtualenv ($("$WORK/venv/bin/python" -c 'import sys,django;print("Python",sys.version.split()[0],"Django",django.__version__)')): pip install of the wheel, no extras"

# The driver runs from the virtualenv, in the temporary directory: nothing of the
# checkout is on its sys.path but the driver's own folder.
(cd "$WORK" && "$WORK/venv/bin/python" "$ROOT/scripts/wheel_smoke/driver.py" "$WORK/work")
echo "wheel smoke: all checks passed in $((SECONDS - start)) s"
