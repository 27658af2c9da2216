"""Stands in for ``vllm.logger`` (vLLM's logging configuration: formatters, uvicorn, JSON config).

Provides: ``init_logger(name)``, a standard ``logging`` logger with vLLM's extra methods
``debug_once`` / ``info_once`` / ``warning_once`` (each message logged once per process).
"""

from __future__ import annotations

import logging

_SEEN: set[tuple[str, str]] = set()


class _Logger(logging.LoggerAdapter):
    def _once(self, level: int, msg: str, *args, **kwargs) -> None:
        key = (self.logger.name, str(msg))
        if key not in _SEEN:
            _SEEN.add(key)
            kwargs.pop("scope", None)
            self.log(level, msg, *args, **kwargs)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args, **kwargs)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})
