"""KV cache events: what an engine's prefix cache stored and evicted, published for routers.

The wire format is vLLM's (photon.kv_events.schema), so routers written for vLLM (NVIDIA Dynamo,
llm-d) read photon's events too. See docs/kv-events.md.
"""
