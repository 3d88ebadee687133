"""Zero-edit capture: tracer.watch / tracer run, name maps, call-site plans, step numbers."""
