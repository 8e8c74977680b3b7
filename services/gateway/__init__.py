"""Gateway: the stateless, client-facing front door (produce, fetch, admin, offsets)."""
