"""The writer process (``TraceWriter(writer="process")``): the parent side in the training process
(:mod:`~tracer.record.process.parent`), starting, watching and stopping the child
(:mod:`~tracer.record.process.lifecycle`), the shared-memory pipe between them
(:mod:`~tracer.record.process.pipe`), and the child that writes the files
(:mod:`~tracer.record.process.child`)."""
