"""Shared pytest fixtures: tiny Hugging Face checkpoints, built once per test session.

The builders live in ``tests/checkpoints.py`` (importable as ``checkpoints`` from any test, and by
the benchmarks) so engine and server tests can reuse them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI replays the same examples on every run (a red CI must be reproducible and never a lucky draw);
# local runs keep exploring new ones. Select explicitly with --hypothesis-profile.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

sys.path.insert(0, str(Path(__file__).resolve().parent))

# One intra-op thread unless the caller says otherwise: the tests' models are tiny, and on a 2-core
# machine two threads per op made the engine tests ~2x slower (synchronising threads costs more than
# the ops). Set before torch is first imported (below), which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU the Triton kernels' tests run them in Triton's interpreter. The variable must be set
# before any test module imports hyla.model.ops.gpu (its kernels read it when they are defined), so
# here, not in the tests that need it: otherwise the suite's order decides whether they pass.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _list_interpreter_builtins_once() -> None:
    """Triton's interpreter patches ``triton.language``'s builtins before every launch and restores
    them after, finding them anew each time with ``inspect.getmembers`` over the module (3.9's
    ``interpreter._patch_builtin``): 13-17% of an interpreted engine test's time (py-spy; a decode
    step launches a few kernels per layer). The builtins never change, so they are listed once per
    module, each with its wrapper (the one ``interpreter._patch_attr`` makes: it passes the
    interpreter's ``_semantic``), made once and cheaper to call (it drops a caller's ``_semantic``
    in place rather than copying the keyword arguments: 7% of an interpreted engine test was that
    copy); each launch still patches and restores them all, as before. A Triton without those
    functions is left alone."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if patch_builtin is None or patch_attr is None or not hasattr(interpreter, "interpreter_semantic") \
            or getattr(patch_builtin, "lists_once", False):
        return
    listed: dict[int, list] = {}

    def wrapper(member):
        def call(*args, **kwargs):  # kwargs: this call's own dict
            kwargs.pop("_semantic", None)
            return member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)
        return call

    def _patch_builtin(pkg, builder, scope):
        if id(pkg) not in listed:  # before the launch patches pkg: its members are still the originals
            listed[id(pkg)] = [(name, wrapper(m)) for name, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, call in listed[id(pkg)]:
            scope.set_attr(pkg, name, call)

    _patch_builtin.lists_once = True
    interpreter._patch_builtin = _patch_builtin


def _patch_language_once_per_launch() -> None:
    """Two more costs of Triton's interpreter that change nothing it computes (py-spy, an
    interpreted verify test). A call of a ``@triton.jit`` helper from inside a kernel patches the
    ``triton.language`` modules its globals name again (``InterpretedFunction.__call__`` ->
    ``_patch_lang``), though the launch around it has patched them already: 9% of the test. Inside
    a launch such a call now patches only modules the launch has not patched yet (a helper of
    ``triton.language`` itself names ``triton.language.core``; like the original, that patch stays
    until the next launch's). ``_get_np_dtype`` builds a dict of 15 dtypes on every call (7%): now
    cached per (hashable) dtype. A Triton without those functions is left alone."""
    import functools
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang, np_dtype = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_get_np_dtype", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or np_dtype is None or executor is None or getattr(patch_lang, "once_per_launch", False):
        return
    launches: list[set[int]] = []  # per launch running: the modules patched in it
    langs_of: dict = {}  # function -> the triton.language modules its globals name (what _patch_lang patches)

    class _Patched:
        def restore(self) -> None:
            pass

    def _patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                             if inspect.ismodule(v) and v in (tl, tl.core))
        if launches and langs <= launches[-1]:
            return _Patched()
        if launches:
            launches[-1].update(langs)
        return patch_lang(fn)

    launch = executor.__call__

    def _launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    _patch_lang.once_per_launch = True
    interpreter._patch_lang = _patch_lang
    executor.__call__ = _launch
    cached = functools.lru_cache(maxsize=None)(np_dtype)

    def _get_np_dtype(tt_dtype):
        try:
            return cached(tt_dtype)
        except TypeError:  # an unhashable type (pointers): as before
            return np_dtype(tt_dtype)

    interpreter._get_np_dtype = _get_np_dtype


def _skip_unasserted_overflow_checks() -> None:
    """Triton's interpreter builds an int32 overflow check for every ``+``, ``-`` and ``*`` of int32
    values in a kernel (``TritonSemantic.binary_op_sanitize_overflow_impl``: the operands widened to
    int64, the op again, two comparisons and an ``and``), then hands it to ``device_assert``, which
    drops it unless the builder's ``debug`` option is set (the interpreter's never is:
    ``InterpreterOptions``): ~20% of an interpreted engine test's time (py-spy, an interpreted MTP
    test) for a condition nothing reads. The interpreter's semantic object now skips building it
    exactly when ``device_assert`` would drop it (a ``debug`` builder still checks, as before); the op
    itself is computed as before. Triton's compiler (its own semantic objects) is untouched. A
    Triton without those names, or whose ``device_assert`` reads its condition without ``debug``
    (checked here once), is left alone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    semantic = getattr(interpreter, "interpreter_semantic", None)
    check = getattr(type(semantic), "binary_op_sanitize_overflow_impl", None)
    if semantic is None or check is None or not hasattr(type(semantic), "device_assert") \
            or "binary_op_sanitize_overflow_impl" in vars(semantic):
        return
    if not semantic.builder.options.debug:  # the premise, checked on this Triton: device_assert drops a
        try:  # condition unread without debug (it would fail on this one if it read it)
            if semantic.device_assert(object(), "", None) is not None:
                return
        except Exception:
            return

    def binary_op_sanitize_overflow_impl(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:  # device_assert's own condition: the check would be dropped
            return None
        return check(semantic, lhs, rhs, binary_op)

    semantic.binary_op_sanitize_overflow_impl = binary_op_sanitize_overflow_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _list_interpreter_builtins_once()
    _patch_language_once_per_launch()
    _skip_unasserted_overflow_checks()

import checkpoints  # noqa: E402  (needs the path above)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first, each file's in order (a stable sort): with several workers (``make
    test``: pytest-xdist, work stealing) none of them starts last, while the others' queues run
    dry. Without a CUDA device the ``gpu`` tests are skipped."""
    import torch

    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per session holding every tiny checkpoint built (builders reuse them)."""
    return tmp_path_factory.mktemp("tiny_checkpoints")


def _tiny_checkpoint(name: str, make, **kw):
    """A session fixture ``name``: the tiny checkpoint ``make(tiny_ckpt_dir, **kw)`` builds (``checkpoints.py``)."""

    def path(tiny_ckpt_dir: Path) -> Path:
        return make(tiny_ckpt_dir, **kw)

    return pytest.fixture(scope="session", name=name)(path)


qwen3_next_dense_path = _tiny_checkpoint("qwen3_next_dense_path", checkpoints.make_qwen3_next, moe=False)
# one layer of each kind: for the tests whose cost is compiling the model (torch.compile's time
# grows with the layers it traces: ~6.5 minutes cold for the 8-layer model's five graphs, 2 for this)
qwen3_next_short_path = _tiny_checkpoint("qwen3_next_short_path", checkpoints.make_qwen3_next, moe=False,
                                         num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
# the same for the interpreted Triton engine tests (tests/test_fused_decode.py: the interpreter's
# time grows with the layers too)
qwen3_5_short_path = _tiny_checkpoint("qwen3_5_short_path", checkpoints.make_qwen3_5, num_hidden_layers=2,
                                      layer_types=["linear_attention", "full_attention"])
qwen3_5_moe_short_path = _tiny_checkpoint("qwen3_5_moe_short_path", checkpoints.make_qwen3_5_moe, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"])
bamba_short_path = _tiny_checkpoint("bamba_short_path", checkpoints.make_bamba, num_hidden_layers=2,
                                    attn_layer_indices=[1])
lfm2_short_path = _tiny_checkpoint("lfm2_short_path", checkpoints.make_lfm2, num_hidden_layers=2,
                                   layer_types=["conv", "full_attention"])
falcon_h1_short_path = _tiny_checkpoint("falcon_h1_short_path", checkpoints.make_falcon_h1, num_hidden_layers=2)
granite_h_short_path = _tiny_checkpoint("granite_h_short_path", checkpoints.make_granite_h, num_hidden_layers=2,
                                        layer_types=["mamba", "attention"])
qwen3_next_moe_path = _tiny_checkpoint("qwen3_next_moe_path", checkpoints.make_qwen3_next, moe=True)
qwen3_next_moe_short_path = _tiny_checkpoint("qwen3_next_moe_short_path", checkpoints.make_qwen3_next, moe=True,
                                             num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
# a single layer (attention + MoE): for the compiled MoE test (test_model_decode.py), whose cost is compiling it
qwen3_next_moe_one_layer_path = _tiny_checkpoint("qwen3_next_moe_one_layer_path", checkpoints.make_qwen3_next, moe=True,
                                                 num_hidden_layers=1, layer_types=["full_attention"])
qwen3_5_path = _tiny_checkpoint("qwen3_5_path", checkpoints.make_qwen3_5)
qwen3_5_moe_path = _tiny_checkpoint("qwen3_5_moe_path", checkpoints.make_qwen3_5_moe)
qwen3_5_vl_path = _tiny_checkpoint("qwen3_5_vl_path", checkpoints.make_qwen3_5_vl)  # with a vision tower
nemotron_h_path = _tiny_checkpoint("nemotron_h_path", checkpoints.make_nemotron_h)
falcon_h1_path = _tiny_checkpoint("falcon_h1_path", checkpoints.make_falcon_h1)
bamba_path = _tiny_checkpoint("bamba_path", checkpoints.make_bamba)
granite_h_path = _tiny_checkpoint("granite_h_path", checkpoints.make_granite_h)
lfm2_path = _tiny_checkpoint("lfm2_path", checkpoints.make_lfm2)
lfm2_moe_path = _tiny_checkpoint("lfm2_moe_path", checkpoints.make_lfm2_moe)
lfm2_moe_short_path = _tiny_checkpoint("lfm2_moe_short_path", checkpoints.make_lfm2_moe, num_hidden_layers=2,
                                       layer_types=["conv", "full_attention"])  # MLP, then MoE
kimi_linear_path = _tiny_checkpoint("kimi_linear_path", checkpoints.make_kimi_linear)
kimi_linear_short_path = _tiny_checkpoint("kimi_linear_short_path", checkpoints.make_kimi_linear, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"])  # MLP, then MoE
bailing_hybrid_path = _tiny_checkpoint("bailing_hybrid_path", checkpoints.make_bailing_hybrid)
bailing_hybrid_short_path = _tiny_checkpoint("bailing_hybrid_short_path", checkpoints.make_bailing_hybrid,
                                             num_hidden_layers=2, layer_group_size=2)  # KDA + MLP, then MLA + MoE
olmo_hybrid_path = _tiny_checkpoint("olmo_hybrid_path", checkpoints.make_olmo_hybrid)
olmo_hybrid_short_path = _tiny_checkpoint("olmo_hybrid_short_path", checkpoints.make_olmo_hybrid, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"])
lara_mini_path = _tiny_checkpoint("lara_mini_path", checkpoints.make_lara_mini)
lara_mini_short_path = _tiny_checkpoint("lara_mini_short_path", checkpoints.make_lara_mini, num_hidden_layers=2,
                                        layer_types=["linear_attention", "sliding_attention"])
lfm3_path = _tiny_checkpoint("lfm3_path", checkpoints.make_lfm3)
lfm3_short_path = _tiny_checkpoint("lfm3_short_path", checkpoints.make_lfm3, num_hidden_layers=2,
                                   layer_types=["conv", "sliding_attention"])
zamba2_path = _tiny_checkpoint("zamba2_path", checkpoints.make_zamba2)
# a Mamba2 layer and two hybrid ones running one shared block
zamba2_short_path = _tiny_checkpoint("zamba2_short_path", checkpoints.make_zamba2, num_hidden_layers=3,
                                     layers_block_type=["mamba", "hybrid", "hybrid"], num_mem_blocks=1)
jamba_path = _tiny_checkpoint("jamba_path", checkpoints.make_jamba)
jamba_short_path = _tiny_checkpoint("jamba_short_path", checkpoints.make_jamba, num_hidden_layers=2, attn_layer_period=2,
                                    attn_layer_offset=1)
# no linear layer at all: attention alone (a tree of KV, no checkpoints)
qwen3_next_attention_path = _tiny_checkpoint("qwen3_next_attention_path", checkpoints.make_qwen3_next, moe=False,
                                             num_hidden_layers=2, layer_types=["full_attention"] * 2)
minimax_path = _tiny_checkpoint("minimax_path", checkpoints.make_minimax)
minimax_short_path = _tiny_checkpoint("minimax_short_path", checkpoints.make_minimax, num_hidden_layers=2,
                                      layer_types=["linear_attention", "full_attention"])
# the pure state-space models (every layer a Mamba1 / Mamba2 mixer: no attention, no MLP)
mamba_path = _tiny_checkpoint("mamba_path", checkpoints.make_mamba)
falcon_mamba_path = _tiny_checkpoint("falcon_mamba_path", checkpoints.make_falcon_mamba)
mamba2_path = _tiny_checkpoint("mamba2_path", checkpoints.make_mamba2)
falcon_mamba_short_path = _tiny_checkpoint("falcon_mamba_short_path", checkpoints.make_falcon_mamba,
                                           num_hidden_layers=2)

# the same checkpoints with a random MTP head (mtp.* tensors) for speculative_algorithm="mtp"
qwen3_next_dense_mtp_path = _tiny_checkpoint("qwen3_next_dense_mtp_path", checkpoints.make_qwen3_next, moe=False,
                                             mtp=True)
qwen3_next_moe_mtp_path = _tiny_checkpoint("qwen3_next_moe_mtp_path", checkpoints.make_qwen3_next, moe=True, mtp=True)
qwen3_5_mtp_path = _tiny_checkpoint("qwen3_5_mtp_path", checkpoints.make_qwen3_5, mtp=True)
qwen3_5_moe_mtp_path = _tiny_checkpoint("qwen3_5_moe_mtp_path", checkpoints.make_qwen3_5_moe, mtp=True)
qwen3_5_short_mtp_path = _tiny_checkpoint("qwen3_5_short_mtp_path", checkpoints.make_qwen3_5, mtp=True,
                                          num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])

# draft models for speculative_algorithm="draft": perturbed copies of the targets (they agree with
# them most of the time), and a small NemotronH (Mamba2, attention, MLP: one layer each) whose
# vocabulary is every tiny checkpoint's, to draft for another architecture
qwen3_next_dense_draft_path = _tiny_checkpoint("qwen3_next_dense_draft_path", checkpoints.make_perturbed,
                                               base=checkpoints.make_qwen3_next, moe=False)
qwen3_next_moe_draft_path = _tiny_checkpoint("qwen3_next_moe_draft_path", checkpoints.make_perturbed,
                                             base=checkpoints.make_qwen3_next, moe=True)
qwen3_5_draft_path = _tiny_checkpoint("qwen3_5_draft_path", checkpoints.make_perturbed, base=checkpoints.make_qwen3_5)
qwen3_5_short_draft_path = _tiny_checkpoint("qwen3_5_short_draft_path", checkpoints.make_perturbed,
                                            base=checkpoints.make_qwen3_5, num_hidden_layers=2,
                                            layer_types=["linear_attention", "full_attention"])
nemotron_h_draft_path = _tiny_checkpoint("nemotron_h_draft_path", checkpoints.make_perturbed,
                                         base=checkpoints.make_nemotron_h)
nemotron_h_small_path = _tiny_checkpoint("nemotron_h_small_path", checkpoints.make_nemotron_h,
                                         layers_block_type=["linear_attention", "full_attention", "mlp"])
