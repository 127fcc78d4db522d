#!/usr/bin/env bash
# Builds libtensorrpc.so and installs the tensorrpc Python package for one
# interpreter, without pip and without network access:
#
#   bash shim/install.sh [PYTHON]        # PYTHON defaults to /usr/bin/python3
#
# 1. go build -buildmode=c-shared writes shim/python/tensorrpc/libtensorrpc.so
#    and libtensorrpc.h (tensorrpc.h, the types, is copied next to them);
# 2. a tensorrpc-shim.pth file in the interpreter's site-packages (its
#    purelib directory as root, the user site otherwise) puts shim/python on
#    its path, like `pip install -e` would;
# 3. `import tensorrpc` is checked.
#
# TENSORRPC_NO_PTH=1 skips step 2; then set PYTHONPATH=<repo>/shim/python.
set -euo pipefail
shim="$(cd "$(dirname "$0")" && pwd)"
python="${1:-/usr/bin/python3}"
export PATH="$PATH:/usr/local/go/bin"
export CGO_ENABLED=1

pkg="$shim/python/tensorrpc"
(cd "$shim/.." && go build -buildmode=c-shared -o "$pkg/libtensorrpc.so" ./shim/capi)
cp "$shim/capi/tensorrpc.h" "$pkg/tensorrpc.h"
echo "built $pkg/libtensorrpc.so"

if [ "${TENSORRPC_NO_PTH:-}" != 1 ]; then
  if [ "$(id -u)" = 0 ]; then
    site="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  else
    site="$("$python" -m site --user-site)"
  fi
  mkdir -p "$site"
  echo "$shim/python" > "$site/tensorrpc-shim.pth"
  echo "installed $site/tensorrpc-shim.pth -> $shim/python"
fi

PYTHONPATH="$shim/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
  'import tensorrpc, sys; print("tensorrpc imports in", sys.executable, "from", tensorrpc.__file__)'
