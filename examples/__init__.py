"""Runnable examples (``make run`` runs ``examples.storage_demo``)."""
