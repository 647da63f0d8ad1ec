"""Errors the engine raises.  All are ValueErrors so callers can treat bad input uniformly."""


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, or not of a supported family."""


class DeviceUnavailableError(ModelLoadError):
    """The device asked for is not on this machine: CUDA without CUDA, or a cuda:N beyond its GPUs."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(f"device {device!r}: {reason}")
        self.reason = reason


class InputError(ValueError):
    """Questions, states or temperatures that cannot be scored."""


class KernelsUnavailableError(ModelLoadError):
    """The kernels a scoring mode needs are not installed here (deterministic scoring on CUDA without fla)."""
