"""``python -m ds4serve`` runs the command line."""

from .cli import main

raise SystemExit(main())
