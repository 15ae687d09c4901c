"""Exceptions and warnings raised by skafa, in one place.

Every error names what it refuses (record, turn, field, site or file).
:class:`StopRequested` (a SIGTERM or Ctrl-C while skafa works) lives in
:mod:`skafa.utils.signals` and is re-exported here.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from .utils.signals import StopRequested

__all__ = [
    "CacheCorruptionWarning",
    "ConfigurationError",
    "ConversationError",
    "DistributionShiftWarning",
    "ModelMismatchWarning",
    "PersistenceVersionWarning",
    "PromptTooLongError",
    "StopRequested",
]


class ConversationError(ValueError):
    """Raised when a record cannot become a valid :class:`Conversation`.

    The message always names the record (when known) and the offending field.
    """


class ConfigurationError(ValueError):
    """Raised when a configuration asks for what the model or the features cannot give.

    For example a site search averaging the ``n_sites`` best sites when fewer
    sites are compared (a small model under ``sites="stride:3"``). The message
    names what was asked and what is available.
    """


class PromptTooLongError(ValueError):
    """Raised when a prompt cannot be made to fit a token limit.

    Attributes
    ----------
    n_tokens : int
        Length of the shortest prompt that could be produced (or of the prompt).
    max_tokens : int
        The limit.
    """

    def __init__(self, message, n_tokens=None, max_tokens=None):
        super().__init__(message)
        self.n_tokens = n_tokens
        self.max_tokens = max_tokens


class CacheCorruptionWarning(UserWarning):
    """A cached entry was unreadable or inconsistent and will be recomputed."""


class ModelMismatchWarning(UserWarning):
    """The model a loaded estimator will use is not the one it was saved with.

    Issued when the architecture fingerprint matches but the model's name,
    path, file or weights digest differs (e.g. another quantization of the same
    model, or a fine-tuned copy): the probe's coefficients were learnt on the
    saved model's activations and may not transfer.
    """


class PersistenceVersionWarning(UserWarning):
    """The file was written by another version of scikit-learn or skafa."""


class DistributionShiftWarning(UserWarning):
    """Runs look unlike the runs a probe was trained on.

    Issued by :class:`skafa.domain.ShiftDetector` (and so by a fitted
    :class:`~skafa.FailureAttributor`) when a run's shift score exceeds the threshold
    calibrated on held-out training runs. A probe trained on one framework scores
    near chance on another's runs: label a few of them (``skafa label``) and refit.
    The message names the runs.
    """
