#!/usr/bin/env bash
# Installs the tensorrpc Python package (and the libtensorrpc.so it builds)
# for one interpreter, offline, with pip:
#
#   bash shim/install.sh [PYTHON [PIP OPTIONS...]]
#
# PYTHON defaults to the `python3` on PATH. This is
# `PYTHON -m pip install ./shim/python` (the package's build backend runs
# `go build -buildmode=c-shared`; it needs Go and gcc, nothing from an
# index) followed by a check that `import tensorrpc` works; when the check
# fails the package is uninstalled again. Examples:
#
#   bash shim/install.sh .venv/bin/python                    # a virtualenv
#   bash shim/install.sh /usr/bin/python3 --user --break-system-packages
#                                                            # Debian's Python (PEP 668)
set -euo pipefail
shim="$(cd "$(dirname "$0")" && pwd)"
python="${1:-python3}"
shift || true
export PATH="$PATH:/usr/local/go/bin"

if ! command -v "$python" >/dev/null 2>&1; then
  echo "install.sh: $python not found; pass the interpreter: bash shim/install.sh /path/to/python3" >&2
  exit 1
fi
if ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "install.sh: $python has no pip. Install it: apt-get install python3-pip (Debian's python3)," >&2
  echo "  or $python -m ensurepip --upgrade; in a virtualenv made with --without-pip, recreate it" >&2
  echo "  (python3 -m venv DIR; Debian needs apt-get install python3-venv)." >&2
  exit 1
fi

# The earlier install.sh put a tensorrpc-shim.pth (shim/python on sys.path)
# into site-packages; it would shadow the installed package.
for site in $("$python" -c 'import site, sysconfig; print(sysconfig.get_paths()["purelib"], site.getusersitepackages())'); do
  if [ -f "$site/tensorrpc-shim.pth" ]; then
    rm -f "$site/tensorrpc-shim.pth" && echo "install.sh: removed the old $site/tensorrpc-shim.pth"
  fi
done

"$python" -m pip install --no-cache-dir "$@" "$shim/python"

# Check from another directory, so that shim/python itself is not on the path.
if ! (cd / && "$python" -c 'import tensorrpc, sys; print("tensorrpc", tensorrpc.__version__, "imports in", sys.executable, "from", tensorrpc.__file__)'); then
  echo "install.sh: import tensorrpc failed after the install; uninstalling it again" >&2
  "$python" -m pip uninstall -y tensorrpc >&2 || true
  exit 1
fi
