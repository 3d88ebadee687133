"""``python -m tracer`` runs the command-line interface."""

from tracer.cli import main

raise SystemExit(main())
