"""The user-facing tools (graphscale/_tools): audit (plain, training, ZeRO 3, FSDP2),
diagnose, explain, and the ``python -m graphscale`` env and demo commands."""
