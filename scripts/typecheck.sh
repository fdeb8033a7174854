#!/usr/bin/env bash
# The type checker (mypy, pinned in the dev extra; its settings in pyproject.toml's [tool.mypy]) over the packages
# held to strict typing. The editable install maps epkit.collectives and epkit.kernels to folders outside
# python/epkit (setup.py's package_dir), which mypy cannot follow: it checks a tree of links that lays the
# sources out as installed (build/typeroot/epkit).
set -euo pipefail
cd "$(dirname "$0")/.."
root=build/typeroot
rm -rf "$root"
mkdir -p "$root/epkit"
for f in python/epkit/*; do ln -s "$PWD/$f" "$root/epkit/"; done
ln -s "$PWD/collectives" "$root/epkit/collectives"
ln -s "$PWD/kernels" "$root/epkit/kernels"
cd "$root"
mypy --config-file "$OLDPWD/pyproject.toml" -p epkit.collectives.ep -p epkit.compat
