"""Drafters behind one protocol (see base.py). The registry: importing a drafter's module registers it,
so each drafter is one line here."""

from specjax.proposers import dflash  # noqa: F401  (registers "dflash")
from specjax.proposers import draft_model  # noqa: F401  (registers "draft_model")
from specjax.proposers import dspark  # noqa: F401  (registers "dspark")
from specjax.proposers import eagle  # noqa: F401  (registers "eagle", "eagle3")
from specjax.proposers import medusa  # noqa: F401  (registers "medusa")
from specjax.proposers import mtp  # noqa: F401  (registers "mtp")
from specjax.proposers import ngram  # noqa: F401  (registers "ngram")
from specjax.proposers.base import (OPTION_IGNORED, PROPOSERS, Context, Proposer, TargetOutput,
                                    UnsupportedSpeculation, WeightlessProposer, build_proposer, check_spec,
                                    proposer_class, register)

__all__ = ["OPTION_IGNORED", "PROPOSERS", "Context", "Proposer", "TargetOutput", "UnsupportedSpeculation",
           "WeightlessProposer", "build_proposer", "check_spec", "proposer_class", "register"]
