"""llama.cpp as a same-run peer for hyla's CPU benchmark (benchmarks/cpu_decode.py).

llama.cpp runs Qwen3-Next natively, so it can serve hyla's built-in default model, converted to GGUF
(fp32, like the benchmark). Build it once with ``scripts/build_llama_cpp.sh`` (CPU only, offline,
llama.cpp as vendored by the ``llama-cpp-python`` sdist), then:

    .venv/bin/python benchmarks/llama_cpp.py --llama-dir ../llama.cpp --threads 1 [--repeats 3]

converts the model (cached), checks that llama.cpp and hyla (fp32, ``hyla.Engine``) produce the same
greedy tokens, and prints llama.cpp's two numbers, measured as cpu_decode.py measures hyla's:

* **batch 1**: decode tok/s after a 512-token prompt: ``llama-bench -p 0 -d 512 -n 128`` processes
  512 random tokens (untimed), then times 128 single-token decode steps (random input tokens, logits
  computed, no sampling): 128 / t. hyla's ``N / (t(1 + N) - t(1))`` cancels prefill the same way.
* **batch 8**: output tok/s of 8 concurrent 128 → 64 requests: 512 output tokens / wall time of the
  whole batch, prefill included, sent as 8 parallel ``/completion`` requests (token-id prompts,
  greedy, EOS ignored) to one ``llama-server`` with 8 slots (continuous batching).

The conversion. llama.cpp's ``qwen3next`` architecture only knows Qwen3-Next's MoE layers (its
loader requires a router, routed experts and a gated shared expert in every layer), while the
default model is dense. A dense SwiGLU MLP is a one-expert MoE, exactly:

* router ``gate`` = zeros ``[1, H]``: softmax over one logit is exactly 1.0, top-1 picks expert 0,
  ``norm_topk_prob`` divides 1.0 by 1.0; the expert's output times 1.0 is itself;
* expert 0 = the dense ``gate_proj`` / ``up_proj`` / ``down_proj`` (same SwiGLU as hyla's MLP);
* shared expert of width 1 with all-zero weights and a zero gate: ``sigmoid(0) * down(silu(0) * 0)``
  is exactly 0.0, and ``x + 0.0 == x``. (Width 1, not the config's 512, so that llama.cpp does not
  pay for a dead MLP; what it still pays for is its MoE plumbing: router, top-k, ``mul_mat_id``.)

The repacked checkpoint is written in fp32 (the default model is stored in bf16), so the converter's
own edits (``1 + w`` for the zero-centred norms, ``-exp(A_log)``) happen in fp32, as hyla's fp32
load does them, not rounded to bf16. The MTP head is dropped (``--no-mtp``): neither side uses it
here. The converter does not recognise the default model's BPE pre-tokenizer by its hash (it hashes
the token ids of a test string, which depend on the vocabulary); its split regex is Qwen2's, so it
is converted as ``qwen2``. Prompts are token ids throughout, so the tokenizer plays no part in the
numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_decode import fresh  # noqa: E402  (the prompts hyla's side draws)
from hyla.engine.engine import DEFAULT_MODEL_DIR  # noqa: E402

# Runs llama.cpp's converter with one fallback: an unrecognised BPE pre-tokenizer is taken to be
# Qwen2's (the default model's split regex is Qwen2's; see the module docstring).
CONVERT_DRIVER = """
import runpy, sys
llama_dir = sys.argv.pop(1)
sys.path[:0] = [llama_dir, llama_dir + "/gguf-py"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
TextModel.get_vocab_base_pre = vocab_base_pre
sys.argv[0] = llama_dir + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def binary(llama_dir: Path, name: str) -> Path:
    """A llama.cpp executable from ``scripts/build_llama_cpp.sh``'s build."""
    path = Path(llama_dir) / "build" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build llama.cpp with scripts/build_llama_cpp.sh")
    return path


# --------------------------------------------------------------------------- conversion


def repack_as_moe(model_dir: Path, out_dir: Path) -> None:
    """Write ``model_dir`` (a dense Qwen3-Next checkpoint) to ``out_dir`` as an fp32 one-expert MoE
    with a zero shared expert of width 1: the same function, in the layout llama.cpp's loader wants."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("num_experts", 0):
        raise ValueError(f"{model_dir} is already a MoE; convert it directly")
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    tensors = {k: v.float() for k, v in tensors.items() if not k.startswith("mtp.")}  # no MTP head
    for i in range(layers):
        mlp = f"model.layers.{i}.mlp"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{mlp}.experts.0.{proj}.weight"] = tensors.pop(f"{mlp}.{proj}.weight")
        tensors[f"{mlp}.gate.weight"] = torch.zeros(1, hidden)  # router: softmax of one logit = 1.0
        tensors[f"{mlp}.shared_expert.gate_proj.weight"] = torch.zeros(1, hidden)
        tensors[f"{mlp}.shared_expert.up_proj.weight"] = torch.zeros(1, hidden)
        tensors[f"{mlp}.shared_expert.down_proj.weight"] = torch.zeros(hidden, 1)
        tensors[f"{mlp}.shared_expert_gate.weight"] = torch.zeros(1, hidden)
    config.update(
        num_experts=1, num_experts_per_tok=1, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=config["intermediate_size"], shared_expert_intermediate_size=1,
        mtp_num_hidden_layers=0, dtype="float32",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # not generation_config.json: no default sampling
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)


def default_gguf(llama_dir: Path, model_dir: Path) -> Path:
    """Where :func:`convert` puts ``model_dir``'s GGUF unless told otherwise."""
    return Path(llama_dir) / "models" / f"hyla-{Path(model_dir).name}-f32.gguf"


def convert(model_dir: Path, llama_dir: Path, out: Path) -> Path:
    """Convert the dense Qwen3-Next checkpoint ``model_dir`` (through :func:`repack_as_moe`) or a
    Qwen3.5 one (as it is) to an fp32 GGUF at ``out`` with ``llama_dir``'s ``convert_hf_to_gguf.py``.
    Cached: skipped when ``out`` is newer than every file of the model."""
    model_dir, llama_dir, out = Path(model_dir), Path(llama_dir), Path(out)
    if out.exists() and out.stat().st_mtime > max(f.stat().st_mtime for f in model_dir.iterdir()):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = model_dir
        if json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3NextForCausalLM"]:
            repack_as_moe(model_dir, Path(tmp))  # llama.cpp's qwen3next is MoE only; its qwen35 loads dense
            source = Path(tmp)
        partial = out.with_name(out.name + ".partial")
        cmd = [sys.executable, "-c", CONVERT_DRIVER, str(llama_dir), str(source), "--outtype", "f32", "--no-mtp",
               "--model-name", model_dir.name, "--outfile", str(partial)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{run.stderr[-4000:]}")
        partial.replace(out)
    return out


# --------------------------------------------------------------------------- batch 1: llama-bench


def prefill_tok_s(llama_dir: Path, gguf: Path, threads: int, prompt: int = 512) -> float:
    """One llama-bench measurement of prefill tok/s of a ``prompt``-token prompt (``-p prompt -n 0``)."""
    return prompt / bench_s(llama_dir, gguf, threads, "-p", prompt, "-n", 0)


def decode_tok_s(llama_dir: Path, gguf: Path, threads: int, prompt: int = 512, new: int = 128) -> float:
    """One llama-bench measurement of decode tok/s after a ``prompt``-token prompt: ``-d prompt``
    fills the context (untimed), ``-p 0 -n new`` times ``new`` single-token decode steps."""
    return new / bench_s(llama_dir, gguf, threads, "-d", prompt, "-p", 0, "-n", new)


def bench_s(llama_dir: Path, gguf: Path, threads: int, *test) -> float:
    """Seconds of one ``llama-bench`` test (``test``: its -p / -n / -d flags). One repetition (``-r
    1``), so that a caller can interleave repeats with other sides."""
    cmd = [binary(llama_dir, "llama-bench"), "-m", gguf, "-t", threads, *test, "-r", 1, "-o", "json"]
    out = subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout
    (result,) = json.loads(out)
    return result["samples_ns"][0] * 1e-9


# --------------------------------------------------------------------------- batch 8: llama-server


class LlamaServer:
    """A ``llama-server`` on a free local port, as a context manager (started on enter, always
    stopped on exit), so that one server serves every repeat.

    ``parallel`` slots with ``ctx_per_slot`` tokens each; ``threads`` for decode and prefill alike;
    no prompt cache reuse (``--cache-reuse 0``, and requests say ``cache_prompt: false``)."""

    def __init__(self, llama_dir: Path, gguf: Path, threads: int, parallel: int = 8, ctx_per_slot: int = 1024,
                 log: Path | None = None):
        self.llama_dir, self.gguf, self.threads = Path(llama_dir), Path(gguf), threads
        port = free_port()
        self.cmd = [binary(llama_dir, "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", port,
                    "-t", threads, "-tb", threads, "--parallel", parallel, "-c", parallel * ctx_per_slot,
                    "--cache-reuse", 0, "--no-webui"]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        with open(self.log or "/dev/null", "w") as log:  # the child keeps its own copy of the handle
            self.proc = subprocess.Popen([str(c) for c in self.cmd], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.cmd}")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError("llama-server did not become healthy in 120 s")
                time.sleep(0.2)
            self.vocab = self.get("/v1/models")["data"][0]["meta"]["n_vocab"]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def complete(self, prompt_ids: list[int], n: int) -> dict:
        """One greedy ``/completion`` of exactly ``n`` tokens (EOS ignored) after token-id ``prompt_ids``."""
        body = {"prompt": prompt_ids, "n_predict": n, "ignore_eos": True, "temperature": 0, "cache_prompt": False,
                "return_tokens": True}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server: {e.code} {e.read().decode(errors='replace')}") from None
        if len(out["tokens"]) != n:
            raise RuntimeError(f"llama-server returned {len(out['tokens'])} tokens, not {n}")
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_output_tok_s(server: LlamaServer, rng: random.Random, batch: int = 8, prompt: int = 128,
                       new: int = 64) -> float:
    """Output tok/s of ``batch`` concurrent ``prompt`` → ``new`` requests (fresh random prompts):
    ``batch * new`` tokens / wall time of the whole batch, prefill included."""
    prompts = [fresh(prompt, rng, server.vocab) for _ in range(batch)]
    start = threading.Barrier(batch + 1)  # every request leaves at once, as one batch

    def request(p: list[int]) -> None:
        start.wait()
        server.complete(p, new)

    with ThreadPoolExecutor(batch) as pool:
        done = [pool.submit(request, p) for p in prompts]
        start.wait()
        t0 = time.perf_counter()
        for f in done:
            f.result()
        return batch * new / (time.perf_counter() - t0)


def greedy_tokens(server: LlamaServer, prompt_ids: list[int], n: int) -> list[int]:
    """llama.cpp's ``n`` greedy tokens after ``prompt_ids`` (EOS ignored)."""
    return server.complete(prompt_ids, n)["tokens"]


def hyla_greedy_tokens(model_dir: Path, prompts: list[list[int]], n: int, threads: int) -> list[list[int]]:
    """hyla's (fp32 ``Engine``) ``n`` greedy tokens after each prompt, one request at a time."""
    import torch

    from hyla import Engine

    torch.set_num_threads(threads)
    engine = Engine(model_dir, dtype="float32", cpu_threads=threads)
    try:
        params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        return [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    finally:
        engine.shutdown()


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_greedy(model_dir: Path, server: LlamaServer, n: int, threads: int) -> None:
    """Print how many of ``n`` greedy tokens llama.cpp and hyla share, on three 512-token random prompts
    and one chat prompt. Both sides ignore EOS differently: llama.cpp bans it (logit -inf), hyla emits it
    and goes on, so a comparison stops at hyla's first EOS."""
    from tokenizers import Tokenizer

    chat = ("<|im_start|>user\nWhat is the capital of France, and what is it famous for?<|im_end|>\n"
            "<|im_start|>assistant\n")
    prompts = {f"512 random ids (seed {seed})": fresh(512, random.Random(seed), server.vocab) for seed in range(3)}
    prompts["chat prompt"] = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(chat).ids
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    ours = hyla_greedy_tokens(model_dir, list(prompts.values()), n, threads)
    for (name, p), mine in zip(prompts.items(), ours):
        theirs = greedy_tokens(server, p, n)
        end = mine.index(eos) if eos in mine else n
        print(f"greedy tokens, {name}: llama.cpp and hyla agree on the first {agreement(theirs, mine)} of {n}"
              + (f" (hyla's EOS at {end})" if end < n else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-dir", type=Path, default=ROOT.parent / "llama.cpp",
                    help="llama.cpp tree built by scripts/build_llama_cpp.sh")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--gguf", type=Path, help="converted model (default: LLAMA_DIR/models/hyla-MODEL-f32.gguf)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=128, help="greedy tokens compared with hyla (0: skip)")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf(args.llama_dir, args.model_dir)
    gguf = convert(args.model_dir, args.llama_dir, gguf)
    print(f"model: {gguf}")
    rng = random.Random(0)
    with LlamaServer(args.llama_dir, gguf, args.threads) as server:
        if args.check_tokens:
            check_greedy(args.model_dir, server, args.check_tokens, args.threads)
        d1, b8 = [], []
        serve_output_tok_s(server, rng)  # warm-up
        for _ in range(args.repeats):
            d1.append(decode_tok_s(args.llama_dir, gguf, args.threads))
            b8.append(serve_output_tok_s(server, rng))
    print(f"llama.cpp decode tok/s, batch 1, after a 512-token prompt, {args.threads} thread(s): "
          f"median {statistics.median(d1):,.0f} of {', '.join(f'{v:,.0f}' for v in d1)}")
    print(f"llama.cpp output tok/s, 8 concurrent 128 → 64 requests, {args.threads} thread(s): "
          f"median {statistics.median(b8):,.0f} of {', '.join(f'{v:,.0f}' for v in b8)}")


if __name__ == "__main__":
    main()
