"""vllm-bole's vLLM adapter: the only package (with ``vllm_bole.plugin``) that imports vLLM.

* :mod:`.config_hook`: the user's ``{"method": "bole_tree", ...}`` speculative config -> vLLM's
  native configuration (installed by :func:`register` in every process that loads the plugin).
* :mod:`.worker`: CPU / GPU workers whose model side is built without vLLM's speculative config.
* :mod:`.runner`: the V1 model-runner mixin (tree steps, verification, commit, drafting).
* :mod:`.layers`: attention / Mamba2 / GDN overrides active during tree steps only.
* :mod:`.proposer`: the class name vLLM's config carries (refuses to be used by vLLM itself).
"""
from __future__ import annotations

import logging


class _ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger as vLLM has configured it at that moment (vLLM
    configures logging per process at engine start, possibly after the plugin loaded)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def route_logs() -> None:
    """The ``vllm_bole`` logger's records go where vLLM's go, at vLLM's level (vLLM configures only
    its own ``vllm`` logger: without this, INFO lines such as "method bole_tree active" were dropped
    by Python's last-resort handler). Left alone when it already has handlers (the application's or
    ours)."""
    log = logging.getLogger("vllm_bole")
    if log.handlers:
        return
    log.addHandler(_ToVllm())
    log.setLevel(logging.DEBUG)  # the level that counts is vLLM's, checked per record
    log.propagate = False


def register() -> None:
    """Route the logs, install the config hook (idempotent). Workers and runners are imported by
    vLLM by name."""
    from vllm_bole.adapter import config_hook

    route_logs()
    config_hook.install()
