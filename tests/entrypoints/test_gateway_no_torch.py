"""The gateway must never import torch (it runs in the HTTP process)."""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import sys
import genserve.entrypoints.app, genserve.entrypoints.cli
from genserve.entrypoints.config import GatewayConfig
genserve.entrypoints.app.create_app(GatewayConfig(), [])
import genserve.bench.serving, genserve.bench.http_vs_offline, genserve.bench.server_process
# What AsyncEngine imports in the gateway process to start and feed its scheduler process.
import genserve.srt.async_engine, genserve.srt.scheduler.process, genserve.supervision
# A vision-language model's placeholder rules (image preprocessing runs in the scheduler).
import genserve.srt.multimodal.processor, genserve.srt.multimodal.processors.qwen2_vl
import genserve.srt.multimodal.processors.llava
assert 'torch' not in sys.modules, 'torch was imported'
"""


def test_gateway_does_not_import_torch():
    result = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
