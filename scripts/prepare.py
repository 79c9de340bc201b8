"""Do the one-time work of a first start at install time: convert the embedded SmolLM2 (GGUF → a Hugging Face
folder in the dflash2 cache, about 45 s on 2 cores) and build the CPU kernels this CPU runs (about 10 s each), so
that the first ``dflash2 serve`` is ready in seconds. ``make install`` runs it; it is safe to run again (both are
cached) and to skip (the first start then does the same work).

    .venv/bin/python scripts/prepare.py
"""

from __future__ import annotations

import logging
import time

from dflash2.models import cpu_kernels, source


def main() -> None:
    """Convert the embedded model and build the supported CPU kernels, logging what was done."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    folder = source.resolve_model(None)
    logging.info("embedded model ready in %s (%.1f s)", folder, time.perf_counter() - start)
    for kernel in cpu_kernels.KERNELS.values():
        if kernel.supported_cpu():
            start = time.perf_counter()
            built = kernel.available()
            logging.info(
                "CPU kernel %s: %s (%.1f s)",
                kernel.name,
                "ready" if built else "not built",
                time.perf_counter() - start,
            )


if __name__ == "__main__":
    main()
