"""Online auditing: score a run turn by turn and raise an alarm at the decisive step.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from ._online import (
    AuditSession,
    OnlineAuditor,
    Verdict,
    conversation_prefix,
    safe_prefix_protocol,
)

__all__ = [
    "AuditSession",
    "OnlineAuditor",
    "Verdict",
    "conversation_prefix",
    "safe_prefix_protocol",
]
