"""Diagnosis: the advisor, the out-of-memory explanation and the printed reports."""
