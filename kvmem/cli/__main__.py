"""``python -m kvmem.cli ...``: the ``kvmem`` command."""

from kvmem.cli import main

raise SystemExit(main())
