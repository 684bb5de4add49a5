"""The core: what every other part stands on (groups, the snapshot, the walk and the
plan, the adapter registry, errors, observation points).  Imports nothing of
graphscale above it."""
