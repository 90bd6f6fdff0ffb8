"""detproxy: an OpenAI-compatible reverse proxy that audits determinism live."""

__all__ = ["__version__"]

__version__ = "0.1.0"
