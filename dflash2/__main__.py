"""``python -m dflash2``: the same command line as ``dflash2``."""

from dflash2.cli import main

raise SystemExit(main())
