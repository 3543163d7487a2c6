"""Test helpers for gradlog: small deterministic models and batches (see :mod:`.zoo`)."""
