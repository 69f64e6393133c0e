"""`sarathictl plan`: the layout, token budget and replica count for a model, GPUs, a workload
and a TBT target, searched with the simulator (controller/simulator) and ranked."""
