"""Test scaffolding for skafa's own estimator checks (not imported by production code)."""
__all__ = []
