"""The README and docs agree with the code."""
