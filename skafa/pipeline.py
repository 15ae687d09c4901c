"""Former home of :class:`AttributionPipeline` (kept so old import paths work).

It now lives in :mod:`skafa.composition`; import it from there or from :mod:`skafa`.
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from .composition import AttributionPipeline, final_step_call, make_attribution_pipeline

__all__ = ["AttributionPipeline", "make_attribution_pipeline", "final_step_call"]
