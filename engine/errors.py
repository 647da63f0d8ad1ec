"""Errors the engine raises.  All are ValueErrors so callers can treat bad input uniformly."""


class ModelLoadError(ValueError):
    """The model directory is missing, incomplete, or not of a supported family."""


class InputError(ValueError):
    """Questions, states or temperatures that cannot be scored."""
