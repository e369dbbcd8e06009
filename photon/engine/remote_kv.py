"""RemoteKV: the scheduler's state of prefill/decode disaggregation (photon.kv_transfer).

Decode side: a request with `do_remote_prefill` gets its prompt's blocks at admission and waits in
`loading` (WAITING_FOR_REMOTE_KV) while the connector's worker side loads them; other requests
keep running. When the load ended it rejoins the waiting queue's head with the loaded tokens
computed, or, after a failure, recomputes its prompt (on_failure "recompute") or fails.
Prefill side: a finished request with `do_remote_decode` keeps its blocks (`sending`, once its
request index is released) until the connector reports the transfer finished: taken by the
decode side, or its lease ran out.

Invariant: a request's blocks are freed exactly once, by the scheduler, when neither a step in
flight nor a transfer reads or writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from photon.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from photon.engine.kv_cache import KVCacheManager, PrefixMatch
    from photon.kv_transfer.base import KVConnectorBase


@dataclass
class LoadOutcome:
    loaded: list[Request] = field(default_factory=list)  # rejoin the waiting queue, computed
    failed: list[Request] = field(default_factory=list)  # recompute or fail (on_failure)


class RemoteKV:
    def __init__(self, connector: KVConnectorBase, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.loading: dict[int, Request] = {}  # by key: blocks allocated, load in flight
        self.sending: dict[int, Request] = {}  # released requests whose blocks a send holds
        self.send_pending: set[int] = set()  # keys whose send has not finished yet
        self.has_planned = False  # loads or saves not yet handed to the runner

    @property
    def busy(self) -> bool:
        return bool(self.loading or self.sending or self.send_pending)

    def start_load(self, req: Request, prefix: PrefixMatch) -> bool | None:
        """Try the request's remote load: True: it waits for its blocks (WAITING_FOR_REMOTE_KV);
        False: no blocks for it now (admission stops); None: nothing to load, compute it."""
        if req.kv_transfer_params is None or req.kv_load_done:
            return None
        num_ext, _ = self.connector.get_num_new_matched_tokens(req, prefix.num_tokens)
        if num_ext <= 0:
            return None  # request_finished releases the producer's transfer
        if not self.kv.allocate(req.key, req.num_prompt_tokens, prefix, req.block_extra):
            return False
        req.kv_load_done = True
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        req.num_computed_tokens = prefix.num_tokens
        req.num_cached_tokens = prefix.num_tokens
        self.connector.update_state_after_alloc(req, self.kv.block_ids(req.key), num_ext)
        self.has_planned = True
        self.loading[req.key] = req
        return True

    def loads_finished(self, keys: set[int], error_blocks: set[int]) -> LoadOutcome:
        """The loads that ended: aborted requests' blocks are freed here, the others sorted."""
        out = LoadOutcome()
        for key in keys:
            req = self.loading.pop(key, None)
            if req is None:
                continue
            failed = not error_blocks.isdisjoint(self.kv.block_table(req.key))
            if req.finished or failed:
                self.kv.free(req.key)  # aborted meanwhile, or nothing usable arrived
                req.num_computed_tokens = 0
            if req.finished:
                continue
            if failed:
                out.failed.append(req)
            else:
                req.kv_loaded = True
                req.num_computed_tokens = req.num_prompt_tokens - 1  # the last: for its logits
                out.loaded.append(req)
            req.status = RequestStatus.WAITING
        return out

    def request_finished(self, req: Request, computed: bool) -> None:
        """The connector learns of the finished request; a prefill whose KV a decode instance
        will load keeps its blocks (`computed`: its prompt's KV is complete)."""
        if req.kv_transfer_params is None:
            return
        blocks = []
        if computed:
            blocks = self.kv.block_ids(req.key)[:self.kv.num_blocks_needed(req.num_prompt_tokens)]
        delay, params = self.connector.request_finished(req, blocks)
        self.has_planned = True
        req.kv_delay_free, req.kv_transfer_params_out = delay, params
        if delay:
            self.send_pending.add(req.key)

    def hold_blocks(self, req: Request) -> bool:
        """At the request's release: True if a send still holds its blocks (kept until then)."""
        if req.kv_delay_free and req.key in self.send_pending:
            self.sending[req.key] = req
            return True
        return False

    def sends_finished(self, keys: set[int], requests: dict[int, Request]) -> None:
        for key in keys:
            self.send_pending.discard(key)
            if self.sending.pop(key, None) is not None:
                self.kv.free(key)
            elif key in requests:
                requests[key].kv_delay_free = False  # not released yet: release frees them

    def build_meta(self):  # noqa: ANN201 - KVConnectorMetadata
        self.has_planned = False
        return self.connector.build_connector_meta()
