"""Verbose progress lines in scikit-learn's style."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

import time

__all__ = ["Timer"]


class Timer:
    """Print ``[Class] ..... message, total=  0.1s`` like scikit-learn's verbose steps."""

    def __init__(self, source, message):
        self.source, self.message = source, message

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.message is not None:
            elapsed = time.perf_counter() - self.start
            head = f"[{self.source}] "
            tail = f"{self.message}, total={elapsed:6.1f}s"
            print(head + "." * max(70 - len(head) - len(tail), 1) + " " + tail, flush=True)
        return False


