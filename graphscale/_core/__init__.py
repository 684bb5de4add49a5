"""The core: what every other part stands on (groups, the snapshot, the
adapter registry, errors, observation points, releases, the table
formatter).  Imports nothing of graphscale above it."""
