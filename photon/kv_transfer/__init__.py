"""Prefill/decode disaggregation: KV connectors move a request's KV cache between instances.

`config.py` parses `--kv-transfer-config`, `params.py` the per-request `kv_transfer_params`,
`base.py` is the connector interface (a scheduler side and a worker side, as vLLM's v1
connector), `registry.py` names the connectors, `planner.py` holds the scheduler side they
share; `shared_memory.py` is the one for two instances on one machine, `nccl.py` (with
`nccl_link.py` and `p2p.py`) moves the KV over torch.distributed send/recv, `nixl.py` (with
`nixl_handshake.py`) has the decode instance read it with NIXL; `addressed.py` holds what the
last two share (the prefill instance's address). docs/disaggregation.md describes the roles and
the request's states.
"""
