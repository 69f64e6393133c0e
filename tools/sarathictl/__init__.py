"""sarathictl: the operator CLI of sarathi-cluster (status, generate, local cluster, benchmarks)."""
