#!/usr/bin/env bash
# CI: the library alone. A fresh virtualenv, torch first (as setup.sh installs it), then `pip install .`
# without extras (no Triton, no recipe), and the README's quickstart on 2 CPU ranks with it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q "torch==${GTC_TORCH_VERSION:-2.13.0}"
"$py" -m pip install -q "$repo"
if "$py" -c "import triton" 2>/dev/null; then
  echo "library.sh: triton is installed by pip install . alone; it must be the [triton] extra" >&2
  exit 1
fi
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "library.sh: pip install . -> $(du -sh "$site" | cut -f1) in site-packages"
cd "$work"  # away from the checkout: the installed package is imported
OMP_NUM_THREADS=1 "$py" "$repo/examples/quickstart.py"
