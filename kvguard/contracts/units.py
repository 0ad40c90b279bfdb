"""Units and shared defaults: defined once, imported everywhere.

Time is integer nanoseconds of event time (``ts_ns``) throughout kvguard; seconds appear only at
the edges (settings, CLI, reports), converted with ``NS_PER_S``.
"""

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000

# The priority of a request that did not say (vLLM's scale is 0-10 here; lower is more important
# only in vLLM's own priority scheduling, so kvguard keeps the middle of the range as neutral).
DEFAULT_PRIORITY = 5
