"""Server-side code of the tidelog services; shared pieces (errors -> gRPC status) live here."""
