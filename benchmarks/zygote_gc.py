"""What a host forked from the engine zygote pays for Python's garbage collector, with and without
`gc.freeze()` in the zygote before the fork (logprob_parity/engines/zygote_server.py).

Why: the zygote holds the imports of the hf and vllm backends (about 645,000 objects on this CPU). A
collection in a forked child walks every one of them and writes its header, so the child copies the
pages it shared with the zygote. Frozen objects are never walked.

    .venv/bin/python benchmarks/zygote_gc.py
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time


def child() -> None:
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    gc.collect()
    churn = [{} for _ in range(200_000)]  # a host's own allocations, then a collection
    del churn
    gc.collect()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    faults = r1.ru_minflt - r0.ru_minflt
    print(
        f"| {'frozen' if gc.get_freeze_count() else 'not frozen'} | {time.process_time() - t:.3f} | {faults:,} | {faults * 4096 / 1e6:.0f} |"
    )
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    from logprob_parity.engines.backends.base import load_backend_class
    from logprob_parity.engines.zygote import PRELOAD

    for name in PRELOAD:
        load_backend_class(name)
    print(f"{len(gc.get_objects()):,} objects after importing the {', '.join(PRELOAD)} backends\n")
    print("| zygote's objects | child's CPU s for two full collections | page faults | MB copied (4 KiB pages) |")
    print("|---|---|---|---|")
    for frozen in (False, True, False, True):
        gc.freeze() if frozen else gc.unfreeze()
        pid = os.fork()
        if pid == 0:
            child()
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
