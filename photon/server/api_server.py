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
    from photon.engine.async_llm import AsyncLLM
    from photon.engine.core_client import CoreClient
    from photon.server.app import build_app
    from photon.server.launch import serve_engine

    spec: ApiServerSpec = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    client = CoreClient.attach(spec.addresses, spec.index, spec.core_pid)
    # Its shutdown closes this server's sockets only: the core belongs to the launcher.
    engine = AsyncLLM(spec.config, client=client)
    try:
        app = build_app(engine, spec.server, engine_metrics=spec.index == 0)
    except BaseException:
        engine.shutdown()
        raise
    return serve_engine(app, engine, fd=spec.fd, log_level=spec.log_level)


if __name__ == "__main__":
    sys.exit(main())
