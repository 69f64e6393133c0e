"""The sarathi-cluster controller: gRPC API, Sarathi scheduler, pipeline dispatch, metrics."""
