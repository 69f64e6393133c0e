"""vLLM side by side on this machine (`make bench-vs-vllm`, issue 21).

vLLM's CPU build lives in a venv of its own (install_vllm.sh), never in the project's. The
driver (`python -m bench_vs_vllm`, run by that venv's Python with tools/ on the path) starts one
server at a time, vLLM's or ours, on the same model folder, drives each with vLLM's own client
`vllm bench serve` at a list of request rates, and writes a Markdown table, a PNG plot and the
capacity under a TBT SLO, and issue 30's targets as met or missed (targets.py, which also
sets several passes side by side). The pure parts (dataset.py, results.py, targets.py)
import nothing beyond the standard library, so the unit tests run them without vLLM;
bubbles.py takes the bubble formula from the repository's own packages
(sarathictl.bench.metrics).
"""
