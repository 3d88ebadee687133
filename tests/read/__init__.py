"""Reading traces: the step listing and several ranks merged."""
