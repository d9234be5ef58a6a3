"""OpenAI-compatible HTTP server (FastAPI): completions, chat, documents, metrics."""

from semkv.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
