"""The trace format: step file names, the summary index and columns, header summaries, integrity."""
