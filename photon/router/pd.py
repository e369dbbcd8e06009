"""The router in front of prefill/decode instances (`--prefill URL... --decode URL...`).

A completions or chat request goes in the two hops of `photon proxy` (photon/proxy/hops.py):
the prefill instance is the one the policy chooses among the prefill instances (prefix_aware:
where the prompt's prefix was prefilled, from their KV events), the decode instance the least
loaded decode instance. Each hop is sent once more, to another instance of its role, when it
fails before its answer's status line arrives (connection refused or dropped, a timeout) or
its instance answers 503; an instance that refuses the connection or answers 503 is out of
rotation until its health check passes. After that, the hop's answer is the client's: a
backend's error as it is, a stream broken off ending with an error event and [DONE]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from photon.proxy.hops import Hop, Role, refuse, relay
from photon.router.events import BlockKey
from photon.router.forward import MAX_ATTEMPTS, Attempt, Unavailable, failed_attempt, no_backend
from photon.router.policies import Decision
from photon.router.router import Router


async def forward_two_hops(router: Router, raw: Request, path: str,
                           body: dict[str, Any]) -> Response:
    hashes = await router.prompt_hashes(path, body)
    chat = path.endswith("/chat/completions")
    return await relay(raw, RouterHops(router, hashes), router.metrics.hops, path, body, chat)


class RouterHops:
    """The HopOpener of one request: its prompt's block chain chooses the prefill instance."""

    def __init__(self, router: Router, hashes: Sequence[BlockKey]) -> None:
        self.router = router
        self.hashes = hashes

    async def open(self, role: Role, method: str, path: str, headers: dict[str, str],
                   body: dict[str, Any] | None = None) -> Hop:
        if role == "prefill" and not self.router.decode_pool.healthy():
            raise no_backend([], "decode instance")  # a prefill no one can decode is waste
        failed: list[Attempt] = []
        for _ in range(MAX_ATTEMPTS):
            decision = self._choose(role, [a.url for a in failed])
            if decision is None:
                break
            if failed:
                self.router.metrics.retries.inc()
            result = await self._attempt(role, decision.url, method, path, headers, body)
            if isinstance(result, Hop):
                return result
            if role == "prefill":
                self.router.not_sent(decision.url, self.hashes)
            failed.append(result)
        raise no_backend(failed, f"{role} instance")

    def _choose(self, role: Role, exclude: Sequence[str]) -> Decision | None:
        if role == "prefill":
            return self.router.choose(self.hashes, exclude)
        return self.router.choose_decode(exclude)

    async def _attempt(self, role: Role, url: str, method: str, path: str,
                       headers: dict[str, str], body: dict[str, Any] | None) -> Hop | Attempt:
        """The hop, its status 200; an Attempt when it is worth another instance; a backend's
        other error answers raise UpstreamError (they are the client's)."""
        router, metrics = self.router, self.router.metrics
        backend = router.backend(url)
        assert backend is not None and router.client is not None
        metrics.requests.labels(url).inc()
        metrics.hop_requests.labels(role).inc()
        request = router.client.build_request(method, url + path, json=body, headers=headers)
        backend.outstanding += 1
        try:
            response = await router.client.send(request, stream=True)
        except BaseException as e:
            backend.outstanding -= 1
            if not isinstance(e, httpx.HTTPError):
                raise
            timeout = isinstance(e, httpx.TimeoutException)
            metrics.hops.error(role, "timeout" if timeout else "unreachable")
            return failed_attempt(router, url, e)
        hop = Hop(role, backend, response)
        if response.status_code == 503:  # its engine is stopped: worth another instance
            try:
                text = (await response.aread()).decode("utf-8", "replace")[:200]
            except httpx.HTTPError:
                text = ""
            finally:
                await hop.close()
            metrics.hops.error(role, "status")
            return failed_attempt(router, url, Unavailable(text))
        if response.status_code != 200:
            raise await refuse(hop, metrics.hops)
        return hop
