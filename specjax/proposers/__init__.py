"""Drafters behind one protocol (see base.py); importing a drafter's module registers it."""

from specjax.proposers import draft_model  # noqa: F401  (registers "draft_model")
from specjax.proposers.base import PROPOSERS, Context, Proposer, TargetOutput, build_proposer, register

__all__ = ["PROPOSERS", "Context", "Proposer", "TargetOutput", "build_proposer", "register"]
