"""`photon router`: an OpenAI-compatible front for several photon (or vLLM) servers that sends
each request to a backend chosen by a policy (round_robin, least_load, prefix_aware), the
prefix-aware one fed by the backends' KV cache events."""
