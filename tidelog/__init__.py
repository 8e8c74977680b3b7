"""tidelog: a replicated, partitioned commit log; SDK and code shared with the services."""

__version__ = "0.1.0"
