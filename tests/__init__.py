"""tracer's test suite, one package per stage (format, formulas, record, zero_edit, read, checks, diff,
views, app, integrations, cli, reliability, demo, docs, architecture) and the shared builders in
``tests.fixtures``. Each folder is a package, so a test module is ``tests.<stage>.test_x`` and pytest
puts the repository root on sys.path: ``tests/app`` never shadows the top-level ``app`` package."""
