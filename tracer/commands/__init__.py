"""The command line's subcommands, one module each (``demo``, ``info``, ``view``, ``diff``, ``check``,
``run``), each with ``main(args) -> exit code``. :mod:`tracer.cli` holds the argument parser and
imports a subcommand's module only when that subcommand runs, so ``tracer --help`` and a mistyped
argument answer without importing torch. Each module imports at its top only the standard library
and :mod:`tracer.errors`; what a command needs (the reader, the checks, torch) is imported inside
its ``main``, after its own arguments were checked.

Exit codes: :mod:`tracer.cli`."""
