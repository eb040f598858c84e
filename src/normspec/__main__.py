"""``python -m normspec``: the ``normspec`` command."""

from normspec.cli import main

raise SystemExit(main())
