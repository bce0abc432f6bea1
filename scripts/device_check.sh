#!/usr/bin/env bash
# Measure genserve's GPU path on one CUDA GPU (H100/H200 class) in under 8 minutes, with random
# weights at real model shapes (no network), and write a markdown table:
#   scripts/device_check.sh [--dry-run] [--out FILE.md] [--only STEP ...]
# --dry-run runs every step at toy sizes on the CPU with no CUDA call: it checks that the steps'
# imports and arguments resolve (CI runs it through tests/test_device_check.py).
# The steps are described in benchmarks/device_check.py (--help).
set -euo pipefail
exec python3 "$(dirname "$0")/../benchmarks/device_check.py" "$@"
