"""Triton kernels of the LLM path, each with a host wrapper that validates its arguments and a
pure-torch reference (`*_ref`) that the tests compare against.

- `decode_attention`: split-KV decode attention over the paged pool (MHA/GQA/MQA).
- `extend_attention`: prefill of new tokens over a cached prefix plus causal self-attention.
- `kv_store`: write new K/V into pool slots. `kv_indices`: request-to-token rows -> indptr/indices.
- `rmsnorm`: fused RMSNorm (+ residual add). `rotary`: rotary embedding, neox and GPT-J.

Modules import triton at import time; import them only when the triton backend is selected.
On CPU they run only under Triton's interpreter (TRITON_INTERPRET=1 set before triton loads).
"""
