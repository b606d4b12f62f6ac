"""Backends by name, as lazy "module:Class" strings: importing core never imports torch or vLLM."""

from logprob_parity.engines.backends.base import BACKEND_REGISTRY, Backend, load_backend_class

__all__ = ["BACKEND_REGISTRY", "Backend", "load_backend_class"]
