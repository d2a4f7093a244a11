#!/usr/bin/env bash
# Makes (or reuses) a Python virtual environment holding the official
# `openai` client, for the server's client tests: tools/openai-venv.sh DIR.
# Needs python3 with venv and access to PyPI on first use.
set -euo pipefail
OPENAI_VERSION="3.57.0"
dir="${1:?usage: tools/openai-venv.sh DIR}"
if "$dir/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    exit 0
fi
python3 -m venv "$dir"
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
