"""The five dimensions of the strategy space (3⁵ = 243 strategies), as values on the wire.

The policy chooses one option per dimension (``kvguard.policy.strategy``); commands carry the
granularity and the handling to the actuators, which execute them on the engine. So the options
are part of the contract between policy, commands and actuators, and live here, in the base.
"""

from __future__ import annotations

from enum import StrEnum


class Granularity(StrEnum):
    REQUEST = "request"  # free all of the victim's pages; it goes back to the waiting queue
    BLOCK = "block"  # free tail pages, keep the (shared) prefix
    TOKEN = "token"  # free the least recently written page runs of the victim


class Selection(StrEnum):
    LRU = "lru"
    PRIORITY = "priority"
    COST = "cost"


class Timing(StrEnum):
    SYNC = "sync"  # act on every tick whose trigger fires
    ASYNC = "async"  # act at most once per scan interval
    PREDICTIVE = "predictive"  # act when the forecast crosses the threshold within the horizon


class HandlingChoice(StrEnum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    CHECKPOINT = "checkpoint"


class Trigger(StrEnum):
    HARD = "hard"  # U_kv or Ψ above the hard threshold
    SOFT = "soft"  # U_kv or Ψ above the soft threshold, or the prediction says so
    FRAGMENTATION = "fragmentation"  # F_ext above its threshold
