"""The edge half: load a bundle and run exact speculative decoding. Imports no torch."""

from .errors import BackendUnavailableError, BundleError, SpecEdgeError
from .generator import GenerationResult, Generator

__all__ = ["BackendUnavailableError", "BundleError", "GenerationResult", "Generator",
           "SpecEdgeError"]
