"""`python -m persia_operator [run|render|crd] ...` (no sub-command: run the operator)."""

from .cli import main

raise SystemExit(main())
