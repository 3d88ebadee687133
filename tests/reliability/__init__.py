"""Corrupt, hostile and failing inputs: crashes, full disks, fuzzed headers, pickles."""
