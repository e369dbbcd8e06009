"""ProxyConfig: the backends of `photon proxy` and its timeouts, checked once."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]  # base URLs of the prefill instances (http://host:port)
    decode: tuple[str, ...]  # base URLs of the decode instances
    connect_timeout_s: float = 5.0  # to open a connection; also the whole of a health check
    timeout_s: float = 600.0  # a backend's longest silence: for a response, a stream's next bytes

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            urls = getattr(self, name)
            if not urls:
                raise ValueError(f"--{name}: give at least one URL of a {name} instance")
            object.__setattr__(self, name, tuple(normalize_url(u, name) for u in urls))
        for name in ("connect_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                flag = "--" + name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"{flag} must be a number of seconds > 0, got {value}")


def normalize_url(url: str, pool: str) -> str:
    """`http://host:port` or `https://...` without a trailing slash; `host:port` means http."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path \
            or parts.query or parts.fragment:
        raise ValueError(f"--{pool}: {url!r} is not a server's base URL; give "
                         f"http://HOST:PORT (or HOST:PORT)")
    return f"{parts.scheme}://{parts.netloc}"
