# Shared by scripts/test, scripts/demo and scripts/bench: create or update the
# project virtualenv ($SYNFLOW_VENV, default .venv) and activate it.
VENV="${SYNFLOW_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.synflow-install-stamp"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "==> installing synflow and its dependencies into $VENV (first run takes a few minutes)"
    python -m pip install --quiet --upgrade pip setuptools wheel
    python -m pip install --quiet -e '.[test,lint]'
    touch "$stamp"
fi
# Write Twisted's plugin cache once so twistd does not warn on every start.
python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))" >/dev/null 2>&1 || true
export SPARK_LOCAL_IP=127.0.0.1
export PYSPARK_PYTHON="$PWD/$VENV/bin/python"
