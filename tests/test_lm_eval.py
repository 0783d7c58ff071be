"""lm-evaluation-harness against ``hyla serve``: a loglikelihood task and a ``generate_until`` task
on a small local dataset (no download) through lm-eval's ``local-completions`` backend, and the
loglikelihoods compared item by item with lm-eval's own ``hf`` backend on the same checkpoint
(fp32, within 1e-4) — the check an evaluation harness user relies on (``echo`` + ``logprobs``)."""

from __future__ import annotations

import json
import os

import pytest

lm_eval = pytest.importorskip("lm_eval")

from hyla.server.app import create_app  # noqa: E402
from hyla.server.launch import BackgroundServer  # noqa: E402
from test_server_openai import MODEL, make_chat_model  # noqa: E402

QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a city in Europe"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "Water is made of hydrogen and", "choices": [" oxygen", " gold", " light, mostly"], "answer": 0},
    {"question": "Hello, how are", "choices": [" you", " they doing today?"], "answer": 0},
]

MC_TASK = """task: hyla_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: hyla_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf_backend(tiny_ckpt_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    path = make_chat_model(tiny_ckpt_dir)
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "hyla_mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "hyla_gen.yaml").write_text(GEN_TASK.format(data=data))
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # (indexing every built-in task: ~10 s)
    app = create_app(path, served_model_name=MODEL, max_total_tokens=4096, max_state_slots=32)
    with BackgroundServer(app) as server:
        served = lm_eval.simple_evaluate(
            model="local-completions", tasks=["hyla_mc", "hyla_gen"], task_manager=tasks, log_samples=True,
            model_args={"base_url": server.url + "/v1/completions", "model": MODEL, "tokenizer": str(path),
                        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1})
    reference = lm_eval.simple_evaluate(
        model="hf", tasks=["hyla_mc"], task_manager=tasks, log_samples=True,
        model_args={"pretrained": str(path), "dtype": "float32", "device": "cpu"})

    def loglikelihoods(results) -> list[float]:
        samples = sorted(results["samples"]["hyla_mc"], key=lambda s: s["doc_id"])
        return [resp[0][0] for s in samples for resp in s["resps"]]

    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    assert len(ours) == sum(len(q["choices"]) for q in QUESTIONS) == len(theirs)
    assert ours == pytest.approx(theirs, abs=1e-4)
    assert served["results"]["hyla_mc"]["acc,none"] == reference["results"]["hyla_mc"]["acc,none"]
    generated = served["samples"]["hyla_gen"]
    assert len(generated) == len(QUESTIONS) and all(isinstance(s["resps"][0][0], str) for s in generated)
    assert "exact_match,none" in served["results"]["hyla_gen"]
