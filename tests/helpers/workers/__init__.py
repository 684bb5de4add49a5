"""Scripts the tests run in child processes (``python tests/helpers/workers/X.py``,
tests/ on PYTHONPATH: :func:`helpers.ranks.child_env`); each also imported by its
test for the oracle or the scenario list it shares."""
