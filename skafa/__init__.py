"""skafa: white-box failure attribution for multi-agent LLM runs, the scikit-learn way."""

from ._version import __version__
from .conversation import Conversation, ConversationError, Turn
from .features import TurnFeatures

__all__ = ["__version__", "Conversation", "ConversationError", "Turn", "TurnFeatures"]
