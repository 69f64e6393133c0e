"""Generated protobuf and gRPC code for sarathi-cluster's contracts.

The sources are the `.proto` files beside this file; regenerate with `make proto`.
"""
