"""Storage plane: storage nodes owning partition logs (engine in ``services.storage.log``)."""
