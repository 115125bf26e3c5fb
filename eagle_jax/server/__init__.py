"""OpenAI-compatible HTTP server: the FastAPI app, the engine thread and its metrics."""

from .app import create_app
from .async_engine import AsyncEngine
from .metrics import ServerMetrics

__all__ = ["create_app", "AsyncEngine", "ServerMetrics"]
