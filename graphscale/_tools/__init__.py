"""The tools on top of the governed backward: explain, audit, diagnose, the demo
and the environment report."""
