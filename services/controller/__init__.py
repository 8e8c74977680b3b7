"""Control plane: the etcd-elected controller (topics, assignment, leaders, ISR)."""
