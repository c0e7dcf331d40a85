#!/usr/bin/env bash
# Sets up a fresh Debian machine (Python >= 3.10, root or sudo) for gtc-lightning and its recipe:
# Debian TTS packages for the embedded corpus, a virtualenv in .venv, torch before anything else
# (a bare "torch" requirement would pull several GB of CUDA packages), then the project.
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES="espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts festvox-us1 festvox-us2 festvox-us3 sox libespeak-ng1"
# festvox-us1/2/3 (festival's MBROLA voices, dev's festival speakers) are in Debian's contrib component and
# pull their diphone databases (mbrola-us1/2/3) from non-free: both are enabled when the sources lack them.
VOICES_LIST=/etc/apt/sources.list.d/gtc-lightning-voices.list
# jemalloc: the allocator run.sh preloads for the lattice decoding (stage 11; run.sh says why)
DECODE_PACKAGES="libjemalloc2"
missing=$(for p in $APT_PACKAGES $DECODE_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! {
    components=$(apt-get indextargets --format '$(COMPONENT)' 2>/dev/null | sort -u)
    # (Debian only: another distribution's sources are left as they are, and the install below says what is missing)
    codename=$(. /etc/os-release && [ "${ID:-}" = debian ] && echo "${VERSION_CODENAME:-}" || true)
    if [ -n "$codename" ] && ! { grep -qx contrib <<<"$components" && grep -qx non-free <<<"$components"; }; then
      # the same keyring as the main source's, else apt refuses two Signed-By values for one source
      keyring=""
      for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && grep -q "deb.debian.org/debian\b" "$f" || continue
        keyring=$(grep -hoE '(Signed-By: *|signed-by=)[^] ]+' "$f" | head -1 | sed -E 's/^(Signed-By: *|signed-by=)//')
        break
      done
      echo "deb ${keyring:+[signed-by=$keyring] }http://deb.debian.org/debian $codename contrib non-free" \
        | $SUDO tee "$VOICES_LIST" >/dev/null
      enabled=1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
  } >/tmp/gtc-apt.log 2>&1; then
    cat /tmp/gtc-apt.log >&2
    echo "setup.sh: could not install the Debian packages the recipe needs (TTS engines and voices, jemalloc):" >&2
    echo "  $missing" >&2
    echo "Install them (apt-get install $APT_PACKAGES $DECODE_PACKAGES; festvox-us1/2/3 need the contrib and non-free" >&2
    echo "components in the apt sources) and run setup.sh again." >&2
    exit 1
  fi
  [ -z "${enabled:-}" ] || echo "setup.sh: enabled Debian's contrib and non-free components ($VOICES_LIST) for the MBROLA voices"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned (GTC_TORCH_VERSION). From PyPI on Linux that is the CUDA build; the CI's hosts
# find a local CPU wheel first. A torch that already imports in .venv is kept: for the CPU build elsewhere
# install it first (pip install torch --index-url https://download.pytorch.org/whl/cpu), as on a GPU machine.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${GTC_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[asr,dev]"
echo "setup.sh: ready (.venv: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)'))"
