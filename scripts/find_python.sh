#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 on this machine, or fails saying where it looked.
# Order (3.12 first, the version the GPU machine runs): $PYTHON, interpreters on PATH, then pyenv's installed versions (whose shims only answer for a
# selected version, so the interpreters are taken from $(pyenv root)/versions directly).
set -u
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
for name in python3.12 python3.13 python3.14 python3 python; do
  path=$(command -v "$name" 2>/dev/null) && candidates+=("$path")
done
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for dir in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
  candidates+=("$dir/bin/python3")
done
for dir in $(ls -d /usr/local/bin /usr/bin /opt/python*/bin 2>/dev/null); do
  for path in "$dir"/python3.1[2-9]; do [ -x "$path" ] && candidates+=("$path"); done
done
for candidate in "${candidates[@]}"; do
  if ok "$candidate"; then echo "$candidate"; exit 0; fi
done
echo "find_python.sh: no Python >= 3.12 found (looked at \$PYTHON, PATH, $root/versions, /usr/local/bin);" \
     "install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2
exit 1
