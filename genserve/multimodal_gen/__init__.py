"""The diffusion engine: image and video generation with diffusers pipelines.

One request's path: the gateway's REST / WebSocket layer builds a `DiffusionRequest`
(messages.py) and hands it to a `DiffusionEngineClient` (client.py). The real client
(engine_client.py) checks it against the model's `ModelSpec` (validation.py; bad input never
reaches the worker) and queues it to the worker process (worker.py), which batches requests of
the same shape (batcher.py) and runs them through the model's pipeline family (pipelines/: one
file per diffusers family; embedded.py builds the offline tiny models) with DBCache step caching
(step_cache.py) and per-step previews (previews.py). Step, result and error events flow back to
the client's per-request asyncio queues; the HTTP layer encodes frames (encoding.py) and keeps
them in a capped store (output_store.py). torch is imported only in the worker process.
"""
