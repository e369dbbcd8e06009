"""One API server process of `photon serve --api-server-count N` (`python -m
photon.server.api_server`): the front end of a shared engine-core process, serving HTTP on a
listening socket inherited from the launcher (photon.server.multi). Its spec comes pickled on
stdin."""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass

from photon.config import EngineConfig
from photon.engine.core_proc import ClientAddresses
from photon.server.openai_serving import ServerConfig


@dataclass(frozen=True)
class ApiServerSpec:
    config: EngineConfig
    server: ServerConfig
    addresses: ClientAddresses  # this server's sockets to the core
    index: int  # 0 .. N-1; server 0 alone reports the engine's own metrics
    core_pid: int
    fd: int  # the shared listening socket
    log_level: str


def main() -> int:
    import uvicorn

    from photon.engine.async_llm import AsyncLLM
    from photon.engine.core_client import CoreClient
    from photon.server.app import build_app

    spec: ApiServerSpec = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    client = CoreClient.attach(spec.addresses, spec.index, spec.core_pid)
    engine = AsyncLLM(spec.config, client=client)
    app = build_app(engine, spec.server, engine_metrics=spec.index == 0)
    try:
        uvicorn.run(app, fd=spec.fd, log_level=spec.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()  # this server's sockets: the core belongs to the launcher
    return 1 if engine.dead.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
