#!/usr/bin/env bash
# Sets up a fresh Debian machine (Python >= 3.10, root or sudo) for gtc-lightning and its recipe:
# Debian TTS packages for the embedded corpus, a virtualenv in .venv, torch before anything else
# (a bare "torch" requirement would pull several GB of CUDA packages), then the project.
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES="espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts sox libespeak-ng1"
missing=$(for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing; } >/tmp/gtc-apt.log 2>&1; then
    cat /tmp/gtc-apt.log >&2
    echo "setup.sh: could not install the Debian packages the embedded TTS corpus needs:" >&2
    echo "  $missing" >&2
    echo "Install them (apt-get install $APT_PACKAGES) and run setup.sh again." >&2
    exit 1
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned: the CPU wheel here; on a GPU machine keep the torch that is installed.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${GTC_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[asr,dev]"
echo "setup.sh: ready (.venv: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)'))"
