"""The errors the hf engine raises."""

from __future__ import annotations


class HFEngineError(RuntimeError):
    """Base class of the errors the hf engine raises."""


class EngineClosedError(HFEngineError):
    """The engine was closed; create a new one to keep generating."""


class EngineNotPausedError(HFEngineError):
    """A weight update was attempted while generation may be running."""


class EngineStepError(HFEngineError):
    """A prefill or decode step failed; the requests in it were failed with this error."""


class UnknownWeightError(HFEngineError, KeyError):
    """A weight name given to `update_weights` is not a parameter or buffer of the model."""


class EngineAsleepError(HFEngineError):
    """The engine is asleep (its KV cache, and perhaps its weights, freed): `wake()` it first."""
