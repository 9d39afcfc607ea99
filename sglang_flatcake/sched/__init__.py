"""Scheduling policy, apart from the index and the SGLang adapter: queues.py (FC-MAS)."""
