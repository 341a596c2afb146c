"""Drafters propose tokens for the target to verify; see base.py for the interface."""

from specchat.engine.drafters.base import Draft, Drafter, NoDrafter, make_drafter

__all__ = ["Draft", "Drafter", "NoDrafter", "make_drafter"]
