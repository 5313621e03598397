"""The project's exceptions. Bad argument values raise plain `ValueError`."""


class SpecEdgeError(Exception):
    """Base class: every failure the user can act on."""


class BundleError(SpecEdgeError):
    """A bundle folder is missing, corrupt, from a newer format, or inconsistent."""


class BackendUnavailableError(SpecEdgeError):
    """The requested backend cannot run on this machine (package, driver or GPU missing)."""
