"""Drafters propose tokens for the target to verify; see base.py for the interface."""

from specchat.engine.drafters.base import Draft, Drafter, NoDrafter, make_drafter
from specchat.engine.drafters.cache import DrafterCache

__all__ = ["Draft", "Drafter", "DrafterCache", "NoDrafter", "make_drafter"]
