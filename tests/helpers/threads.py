"""Running callables on threads released together, for the concurrency workers."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence


def run_threads(work: Sequence[Callable[[], None]]) -> list[str]:
    """Run each callable on its own thread, all released together; the errors."""
    barrier, errors = threading.Barrier(len(work)), []

    def body(fn: Callable[[], None]) -> None:
        try:
            barrier.wait()
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported, not raised on a thread
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(fn,)) for fn in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
