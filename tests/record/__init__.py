"""Recording: TraceWriter, capture and sampling, the writer thread and the writer process."""
