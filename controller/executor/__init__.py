"""Where micro-batches run: real stage workers over ZeroMQ, or a simulated pipeline."""
