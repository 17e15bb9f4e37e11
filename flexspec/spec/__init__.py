"""Speculative decoding: drafter interface + registry (one file per method), verification, metrics."""
