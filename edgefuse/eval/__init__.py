"""Evaluation shared by every phase: benchmark queries (MMLU, GSM8K, Dolly), their scoring,
and the named slices of the public split."""
