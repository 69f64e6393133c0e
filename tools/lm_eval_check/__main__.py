"""lm-evaluation-harness against a running cluster, and against its own `hf` model on the same
weights: the scores must agree (issue 22, item 7).

    PYTHONPATH=tools .venv-lmeval/bin/python -m lm_eval_check --sarathictl .venv/bin/sarathictl \
        --model .cache/models/smollm2-135m-instruct --results bench-results/lm-eval

(`make bench-lm-eval` installs lm-eval into .venv-lmeval first and runs this.) Two tasks kept in
tasks/ with their data, no hub: `sarathi_mc` (loglikelihood: lm-eval's local-completions client
sends echo, logprobs and max_tokens 0, and scores each choice from the prompt's
log-probabilities) and `sarathi_gen` (greedy generation up to a newline). Both runs are float32,
so the per-choice log-likelihoods are compared too, not only the scores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_vs_vllm.servers import ServerSpec, serving

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = "sarathi_mc,sarathi_gen"
METRICS = {"sarathi_mc": "acc,none", "sarathi_gen": "exact_match,strip"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lm_eval_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--sarathictl", type=Path, required=True, help="the project's sarathictl")
    p.add_argument("--model", type=Path, required=True, help="model folder (safetensors)")
    p.add_argument("--results", type=Path, default=Path("bench-results/lm-eval"))
    p.add_argument("--port", type=int, default=8311, help="our OpenAI port while it runs")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages of our cluster")
    p.add_argument(
        "--lm-eval", default=str(Path(sys.executable).with_name("lm_eval")), help="lm_eval binary"
    )
    return p.parse_args(argv)


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path, extra: list[str]) -> float:
    """One lm_eval run over the tasks, its samples logged; returns its wall seconds."""
    command = [
        lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASKS,
        "--include_path", str(TASKS_DIR), "--output_path", str(out), "--log_samples", *extra,
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    start = time.monotonic()
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(command, check=True, cwd=TASKS_DIR, env={**_base_env(), **env})
    return time.monotonic() - start


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def load_run(out: Path) -> tuple[dict[str, float], dict[str, list[list[float]]]]:
    """(task -> score, task -> per-document choice log-likelihoods) of an lm_eval output folder."""
    results = sorted(out.rglob("results_*.json"))[-1]
    scores = {
        task: json.loads(results.read_text())["results"][task][metric]
        for task, metric in METRICS.items()
    }
    loglikelihoods: dict[str, list[list[float]]] = {}
    for samples in sorted(out.rglob("samples_sarathi_mc_*.jsonl")):
        docs = [json.loads(line) for line in samples.read_text().splitlines()]
        docs.sort(key=lambda d: d["doc_id"])
        loglikelihoods["sarathi_mc"] = [[float(r[0][0]) for r in d["resps"]] for d in docs]
    return scores, loglikelihoods


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model.resolve()
    results = args.results.resolve()
    served_out, hf_out = results / "served", results / "hf"
    command = [
        str(args.sarathictl), "up", "--local", "--model", str(model), "--pp", str(args.pp),
        "--dtype", "float32", "--port", "0", "--http-port", str(args.port), "--no-restart",
    ]  # fmt: skip
    spec = ServerSpec("sarathi", command, args.port)
    with serving(spec, results / "sarathi.log"):
        served_args = (
            f"model={model.name},base_url={spec.base_url}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={model},num_concurrent=4,max_retries=3,"
            "tokenized_requests=True"
        )
        served_s = run_lm_eval(args.lm_eval, "local-completions", served_args, served_out, [])
    hf_args = f"pretrained={model},dtype=float32"
    hf_extra = ["--device", "cpu", "--batch_size", "8"]
    hf_s = run_lm_eval(args.lm_eval, "hf", hf_args, hf_out, hf_extra)

    served_scores, served_ll = load_run(served_out)
    hf_scores, hf_ll = load_run(hf_out)
    pairs = [
        (a, b)
        for doc_a, doc_b in zip(served_ll["sarathi_mc"], hf_ll["sarathi_mc"], strict=True)
        for a, b in zip(doc_a, doc_b, strict=True)
    ]
    max_diff = max(abs(a - b) for a, b in pairs)
    summary = {
        "model": model.name,
        "pp": args.pp,
        "scores": {"served": served_scores, "hf": hf_scores},
        "choice_loglikelihoods_compared": len(pairs),
        "choice_loglikelihood_max_abs_diff": max_diff,
        "wall_s": {"served": round(served_s, 1), "hf": round(hf_s, 1)},
    }
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    same = all(math.isclose(served_scores[t], hf_scores[t], abs_tol=1e-9) for t in METRICS)
    print(
        f"scores {'equal' if same else 'DIFFER'}; {len(pairs)} choice log-likelihoods within "
        f"{max_diff:.2e} of lm-eval's hf model"
    )
    return 0 if same and max_diff < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
