#!/usr/bin/env bash
# Installs the pinned openai package (requirements-openai.txt) for this python3 into a
# cache directory named after the pins and the Python version, once, and prints the
# directory: `make sdk-test` puts it on PYTHONPATH for the openai adapter's tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
reqs="$here/requirements-openai.txt"
cache="${AGENTRUN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/agentrun-operator}"
py="$(python3 -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
dir="$cache/sdk-python-deps/$py-$(sha256sum "$reqs" | cut -c1-12)"
if [[ ! -f "$dir/.complete" ]]; then
  python3 -m pip --version >/dev/null 2>&1 || { echo "sdk/python/deps.sh: python3 -m pip is required" >&2; exit 1; }
  echo "sdk/python/deps.sh: installing $(grep -c '==' "$reqs") pinned packages into $dir" >&2
  rm -rf "$dir.tmp"
  # --no-deps: the file pins the whole closure; the host's own packages play no part.
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --only-binary=:all: \
    --target "$dir.tmp" -r "$reqs" >&2
  rm -rf "$dir"; mv "$dir.tmp" "$dir"
  touch "$dir/.complete"
fi
echo "$dir"
