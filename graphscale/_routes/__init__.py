"""The two routes of a governed backward: the native one (``native.py``: one
call into the extension) and the Python one (``python.py``, the reference),
with the self-test that checks one against the other before the native route
governs anything."""
