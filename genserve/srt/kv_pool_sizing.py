"""How a model runner sizes its KV pool: its own default, or the server's memory plan
(`genserve/memory_plan.py`), asked once the weights are in and, for a compiling runner on a
host, answered after its compile warm-up. A mixin of `ModelRunner`, which holds the state
these methods read (config, dtype, device, args, the model, its head geometry)."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import psutil
import torch

from genserve.device_memory import device_memory
from genserve.srt.mem_cache import kv_bytes_per_token

logger = logging.getLogger("genserve.srt.model_runner")

# Upper bound for automatic pool sizing: plenty for a CPU box, cheap to index.
_MAX_AUTO_TOKENS = 1 << 20
# Default share of host memory the KV pool takes on CPU, and of total GPU memory that weights,
# activations and the KV pool take together on CUDA (SGLang's static memory fraction).
CPU_MEM_FRACTION = 0.1
CUDA_MEM_FRACTION = 0.85


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class KVPoolSizing:
    def kv_bytes_per_token(self) -> int:
        """What one token takes in this runner's KV pool, over every layer."""
        cfg = self.config
        layers, heads, head_dim = cfg.num_hidden_layers, self.num_kv_heads, self.head_dim
        return kv_bytes_per_token(self.dtype, layers, heads, head_dim, self.latent_kv)

    def activation_bytes(self) -> int:
        """Upper estimate of one forward's transient memory: the widest per-token tensors of a
        full prefill chunk (q/k/v, gate/up, residual stream) and the float32 logits."""
        cfg = self.config
        elt = torch.tensor([], dtype=self.dtype).element_size()
        tokens = self.args.chunked_prefill_size + self.args.max_running_requests
        # Latent attention's queries and keys are latent rows (kv_lora_rank + rope) wide.
        head_dim = self.head_dim if self.latent_kv is None else sum(self.latent_kv)
        qkv = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        width = qkv + 3 * cfg.intermediate_size + 4 * cfg.hidden_size
        logits = self.args.max_running_requests * cfg.vocab_size * 4 * 3
        return tokens * width * elt + logits

    def memory_report(self) -> dict:
        """What the server's memory plan needs of this runner once its weights are in: the
        device's numbers, the resident weights (on CUDA what torch's allocator holds), the KV
        bytes per token, and on a CPU the pool this runner would size itself (kept unless the
        plan has less)."""
        weights = _tensor_bytes(itertools.chain(self.model.parameters(), self.model.buffers()))
        if self.device.type == "cuda":
            weights = torch.cuda.memory_reserved(self.device)
        own = None
        if self.device.type != "cuda" and self.args.max_total_tokens is None:
            own = self._pool_size()
        return {**device_memory(self.device), "weights_bytes": weights,
                "kv_bytes_per_token": self.kv_bytes_per_token() + self.shared_kv_bytes_per_token,
                "context_length": self.context_length,
                "activation_bytes": self.activation_bytes() if self.device.type == "cuda" else 0,
                "fixed_tokens": self.args.max_total_tokens, "default_tokens": own}

    def _first_pool(self, plan_pool: Any) -> int:
        """The KV pool to start with. A runner that compiles its decode step on a host (one
        rank, no draft model) sends its report and starts on its own default pool without
        waiting, since there the plan can only keep that pool or shrink it: the compile
        warm-up then overlaps the other runtimes' loading, and `settle_planned_pool` takes the
        plan's answer after it. Every other runner waits for the plan here."""
        if plan_pool is None:
            return self._pool_size()
        report = self.memory_report()
        early = (self.compiled and report["default_tokens"] is not None and self.tp.size == 1
                 and not self.shared_kv_bytes_per_token and hasattr(plan_pool, "send"))
        if not early:
            return plan_pool(report)
        plan_pool.send(report)
        self._plan_answer = plan_pool.receive
        return report["default_tokens"]

    def settle_planned_pool(self) -> bool:
        """Take the memory plan's answer for a runner that started on its own default pool
        (`_first_pool`); raises the plan's refusal. When the plan gives less, the pools are
        rebuilt at its size (and the decode step is compiled anew, its pool shape being part
        of the graph) and this returns True: the caller builds a new scheduler over them."""
        if self._plan_answer is None:
            return False
        answer, self._plan_answer = self._plan_answer, None
        tokens = answer()
        if tokens == self.max_total_tokens:
            return False
        logger.info("memory plan: KV pool %d tokens instead of this runner's default %d",
                    tokens, self.max_total_tokens)
        del self.token_to_kv_pool, self.allocator, self.attn_backend
        self._build_pools(tokens)
        if self.compiled:
            self._compiled_decode = self._compile_decode()
        return True

    def _pool_size(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        if self.device.type == "cuda":
            # Weights are already resident: what the static fraction of the GPU leaves after
            # them (and after this forward's activations) is the KV pool.
            free, total = torch.cuda.mem_get_info(self.device)
            fraction = self.args.mem_fraction or CUDA_MEM_FRACTION
            budget = free - total * (1 - fraction) - self.activation_bytes()
            if budget <= 0:
                raise ValueError(
                    f"no GPU memory left for the KV pool: {free / 2**30:.1f} GiB free of "
                    f"{total / 2**30:.1f} GiB after loading the weights, mem_fraction "
                    f"{fraction}; raise --mem-fraction or use a smaller model"
                )
        else:
            fraction = self.args.mem_fraction or CPU_MEM_FRACTION
            budget = psutil.virtual_memory().available * fraction
        tokens = int(budget) // (self.kv_bytes_per_token() + self.shared_kv_bytes_per_token)
        # Rounded down to a power of two: free memory differs a little from start to start,
        # and the pool's size is a static shape of the compiled decode graph, so an exact
        # size would give every start a new graph and defeat the compile cache.
        tokens = max(256, min(tokens, _MAX_AUTO_TOKENS))
        return 1 << (tokens.bit_length() - 1)
