"""Generated gRPC stubs for tidelog.v1 (do not edit; run make protos)."""
