#!/usr/bin/env bash
# Runs torch_crosscheck.py with a Python that has torch (Debian's python3-torch lives under
# /usr/bin/python3, which may not be the python3 first on PATH). Exit 77 = skipped.
here=$(dirname "$0")
for py in /usr/bin/python3 python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch, numpy" >/dev/null 2>&1; then
    exec "$py" "$here/torch_crosscheck.py" "$@"
  fi
done
echo "SKIP: no Python with torch and numpy (apt-get install python3-torch); the cross-check is optional"
exit 77
