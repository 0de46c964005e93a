# Shared by scripts/test, scripts/demo, scripts/bench and scripts/synflowctl:
# create or update the project virtualenv ($SYNFLOW_VENV, default .venv) with
# the extras the calling script needs ($SYNFLOW_EXTRAS, comma-separated, set by
# the caller; installing one never removes another) and activate it. A virtualenv left half-made by an interrupted or
# failed `python -m venv` is detected and rebuilt.
VENV="${SYNFLOW_VENV:-.venv}"
PY="${PYTHON:-python3}"
EXTRAS="${SYNFLOW_EXTRAS:-}"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found: install Python 3.11 or newer (apt-get install python3 python3-venv)" >&2
    exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: synflow needs Python 3.11 or newer, $PY is $("$PY" -c 'import platform; print(platform.python_version())')" >&2
    exit 1
fi
if [ -e "$VENV" ] && { [ ! -f "$VENV/bin/activate" ] || ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }; then
    echo "==> $VENV is half-made (no bin/activate or no working python): rebuilding it"
    rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtualenv $VENV"
    if ! "$PY" -m venv "$VENV" >/dev/null 2>&1 || [ ! -f "$VENV/bin/activate" ]; then
        rm -rf "$VENV"
        echo "error: '$PY -m venv' failed: install the venv module (apt-get install python3-venv)" >&2
        exit 1
    fi
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# Reinstall when the metadata changed since the last install, or when a
# requirement of synflow or of a wanted extra is not installed.
stamp="$VENV/.synflow-install-stamp"
missing="$(python - "$EXTRAS" <<'PY' 2>/dev/null || echo "synflow"
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
extras = {e for e in sys.argv[1].split(",") if e}
missing = []
for line in requires("synflow") or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
        continue
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            missing.append(req.name)
    except PackageNotFoundError:
        missing.append(req.name)
print(" ".join(missing))
PY
)"
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ -n "$missing" ]; then
    echo "==> installing synflow${EXTRAS:+[$EXTRAS]} into $VENV (first run takes a few minutes)"
    python -m pip install --quiet --upgrade pip setuptools wheel
    python -m pip install --quiet -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$stamp"
fi
# Write Twisted's plugin cache once so twistd does not warn on every start.
python -c "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))" >/dev/null 2>&1 || true
export SPARK_LOCAL_IP=127.0.0.1
PYSPARK_PYTHON="$(cd "$VENV" && pwd)/bin/python"  # absolute, whether $VENV is or not
export PYSPARK_PYTHON
# Compile the project's own modules ahead of time. Where PYTHONDONTWRITEBYTECODE is set, Python
# never caches them, and every process (each twistd of a deployment) compiled them all again at
# start: about a quarter of a process's start-up CPU. Up-to-date files are skipped.
python -m compileall -q synflow spark scripts tests examples twisted >/dev/null 2>&1 || true
