"""The Hugging Face hub, asked politely: is offline mode requested, is the endpoint reachable (with a timeout of
our own), and offline mode for one call. Shared by datasets from the hub (trainer/core/data.py) and models from the
hub (models/hf.py), so that an offline machine fails in a second with one line instead of retrying for tens of
seconds."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

HUB_PROBE_TIMEOUT_S = 2.0
_TRUE = {"1", "true", "yes", "on"}
_FLAGS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def offline_requested() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE in the environment, or `datasets`' own flag."""
    env = any(os.environ.get(v, "").strip().lower() in _TRUE for v in _FLAGS)
    try:
        import datasets

        return env or bool(datasets.config.HF_HUB_OFFLINE)
    except ImportError:
        return env


@contextlib.contextmanager
def forced_offline() -> Iterator[None]:
    """Offline mode for one call. The libraries read the env vars at import time, so their module flags are
    switched too; setting only the env would be ignored by an already imported `datasets`."""
    import huggingface_hub.constants as hub_constants

    try:
        import datasets
    except ImportError:
        datasets = None  # type: ignore[assignment]
    saved_env = {n: os.environ.get(n) for n in _FLAGS}
    saved_hub = hub_constants.HF_HUB_OFFLINE
    saved_ds = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE) if datasets else None
    for n in _FLAGS:
        os.environ[n] = "1"
    hub_constants.HF_HUB_OFFLINE = True
    if datasets:
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        for n, v in saved_env.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        hub_constants.HF_HUB_OFFLINE = saved_hub
        if datasets and saved_ds is not None:
            datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved_ds


_probed: dict[tuple[str, int], bool] = {}  # (host, port) -> reachable: one probe per process and address


def reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(can a TCP connection be made, what was probed): the hub endpoint, or the proxy the environment routes it
    through (HTTPS_PROXY / HTTP_PROXY, unless NO_PROXY names the host). Run in a thread because name resolution has
    no timeout of its own; without this a dead resolver would stall for tens of seconds. One probe per address and
    process: a model's config, weights and tokenizer ask in turn."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    where = f"{host}:{port}"
    proxy = urllib.request.getproxies().get(url.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or host, p.port or (443 if p.scheme == "https" else 80)
        where = f"{where} via proxy {host}:{port}"
    if (host, port) not in _probed:
        _probed[host, port] = _connects(host, port, timeout)
    return _probed[host, port], where


def _connects(host: str, port: int, timeout: float) -> bool:
    result: dict[str, bool] = {}

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result["ok"] = True
        except OSError:
            result["ok"] = False

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return result.get("ok", False)
