"""OpenAI-compatible HTTP server.

``app``: the FastAPI app, its routes and middleware. ``protocol``: the wire schema.
``serving_completions`` / ``serving_chat`` / ``serving_tokenization`` / ``serving_models``:
each endpoint's handling and formatting, on the shared ``serving_engine``.
``async_engine``: the engine thread and the choices of a request. ``metrics``: Prometheus.
"""

from .app import create_app
from .async_engine import AsyncEngine
from .metrics import ServerMetrics

__all__ = ["create_app", "AsyncEngine", "ServerMetrics"]
