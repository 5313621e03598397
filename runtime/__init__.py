"""The edge half: load a bundle and run exact speculative decoding. Imports no torch."""

from specedge.runtime.config import GenerationConfig
from specedge.runtime.errors import BackendUnavailableError, BundleError, SpecEdgeError
from specedge.runtime.generator import GenerationResult, Generator

__all__ = ["BackendUnavailableError", "BundleError", "GenerationConfig", "GenerationResult",
           "Generator", "SpecEdgeError"]
